"""The server's building blocks without a server: request limits, API keys, TLS config, and the
per-stream buffer that never grows and never blocks the engine thread."""

import time

import pytest

from jaxserve.host.request import CompletionOutput, RequestOutput, SamplingParams
from jaxserve.server import limits
from jaxserve.server.auth import ApiKeys
from jaxserve.server.config_file import TLSConfig, load_config
from jaxserve.server.request_stream import Delta, RequestStream

LIMITS = limits.RequestLimits.for_engine(
    max_model_len=128,
    vocab_size=1000,
    max_stop_strings=4,
    max_stop_string_bytes=32,
    max_stop_token_ids=8,
    max_id_length=16,
)


def test_prompt_bytes_default_from_max_model_len_and_are_checked_before_encoding():
    assert LIMITS.max_prompt_bytes == 128 * limits.PROMPT_BYTES_PER_TOKEN
    limits.check_prompt(LIMITS, "\u00e9" * (LIMITS.max_prompt_bytes // 2), [])
    with pytest.raises(ValueError, match="server.max_prompt_bytes"):
        limits.check_prompt(LIMITS, "\u00e9" * (LIMITS.max_prompt_bytes // 2 + 1), [])
    assert limits.utf8_size_exceeds("\U0001f600" * 3, 11) and not limits.utf8_size_exceeds("\U0001f600" * 3, 12)
    with pytest.raises(ValueError, match="exactly one"):
        limits.check_prompt(LIMITS, "text", [1])
    with pytest.raises(ValueError, match="max_model_len"):
        limits.check_prompt(LIMITS, "", [1] * 129)


@pytest.mark.parametrize(
    "stop,stop_token_ids,message",
    [
        (["a"] * 5, [], "server.max_stop_strings"),
        (["a" * 20, "\u00e9" * 7], [], "server.max_stop_string_bytes"),
        ([], list(range(9)), "server.max_stop_token_ids"),
        ([], [3, -1], "outside the vocabulary"),
        ([], [1000], "outside the vocabulary"),
    ],
)
def test_stop_limits(stop, stop_token_ids, message):
    with pytest.raises(ValueError, match=message):
        limits.check_stops(LIMITS, stop, stop_token_ids)


def test_a_request_at_every_limit_fits_the_size_checked_before_parsing():
    from jaxserve.client import build_request

    wide = "\U0001f600"  # 4 bytes in UTF-8
    stops = [wide * (LIMITS.max_stop_string_bytes // 4 // LIMITS.max_stop_strings)] * LIMITS.max_stop_strings
    common = dict(
        max_tokens=2**31 - 1,
        temperature=1.5,
        top_k=2**31 - 1,
        top_p=0.5,
        min_p=0.5,
        seed=2**63 - 1,
        stop=stops,
        stop_token_ids=[LIMITS.vocab_size - 1] * LIMITS.max_stop_token_ids,
        ignore_eos=True,
        logprobs=2**31 - 1,
        request_id=wide * LIMITS.max_id_length,
        session_id=wide * LIMITS.max_id_length,
    )
    for prompt in (wide * (LIMITS.max_prompt_bytes // 4), [2**31 - 1] * LIMITS.max_prompt_tokens):
        size = len(build_request(prompt, **common).SerializeToString())
        assert size <= LIMITS.max_generate_request_bytes
    with pytest.raises(ValueError, match="server.max_prompt_bytes"):
        limits.check_request_size(LIMITS.max_generate_request_bytes + 1, LIMITS.max_generate_request_bytes)


def test_id_lengths_and_offline_stop_token_ids():
    limits.check_ids(LIMITS, request_id="r" * 16, session_id="")
    with pytest.raises(ValueError, match="session_id.*server.max_id_length"):
        limits.check_ids(LIMITS, request_id="r", session_id="s" * 17)
    with pytest.raises(ValueError, match="non-negative"):
        SamplingParams(stop_token_ids=[5, -1])


def test_api_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nfirst-key\n\n  second-key  \n")
    keys = ApiKeys.from_file(str(path))
    assert keys.allows("Bearer first-key") and keys.allows("bearer second-key")
    for value in (None, "", "first-key", "Bearer", "Bearer first", "Basic first-key", "Bearer first-key2"):
        assert not keys.allows(value), value
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeys.from_file(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeys.from_file(str(tmp_path / "missing"))


def test_server_config_keys():
    config = load_config(
        None,
        [
            "server.tls={cert: s.pem, key: s.key, client_ca: ca.pem}",
            "server.api_keys=keys",
            "server.stream_idle_timeout=5",
            "server.max_message_bytes=65536",
        ],
    )
    assert config.server.tls == TLSConfig("s.pem", "s.key", "ca.pem")
    assert config.server.api_keys == "keys" and config.server.max_message_bytes == 65536
    with pytest.raises(ValueError, match="server.tls"):
        load_config(None, ["server.tls={cert: s.pem}"])
    with pytest.raises(ValueError, match="stream_idle_timeout"):
        load_config(None, ["server.stream_idle_timeout=0"])
    assert load_config("configs/llama-cpu.yaml").server.host == "127.0.0.1"
    derived = load_config(None, ["engine.max_model_len=4096"]).server.max_message_bytes
    assert derived == limits.default_max_message_bytes(4096) and 64 * 1024 < derived < 1024 * 1024
    small = load_config(None, ["engine.max_model_len=128"]).server.max_message_bytes
    # room for a grammar or tools at the structured-output cap, whatever the context length
    assert limits.MIN_MESSAGE_BYTES <= small < derived and small > 2 * limits.RequestLimits.max_structured_bytes


def test_served_model_names_and_cors_origins():
    config = load_config(None, ["server.served_model_name=[main, alias]", "server.cors_allowed_origins=['*']"])
    assert config.server.served_model_names == ("main", "alias") and config.server.cors_allowed_origins == ("*",)
    single = load_config(None, ["server.served_model_name=main"]).server
    assert single.served_model_names == ("main",) and load_config().server.served_model_names == ()
    assert load_config().server.cors_allowed_origins == ()  # off unless asked for
    for override, message in (
        ("server.served_model_name=[]", "a name or a list of names"),
        ("server.served_model_name=[a, a]", "names one model twice"),
        ("server.served_model_name={a: 1}", "served_model_name must be a string or a list of strings or null"),
        ("server.cors_allowed_origins=['https://ui.example/']", "is not an origin"),  # browsers send no slash
        ("server.cors_allowed_origins=['ui.example:3000']", "is not an origin"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])


@pytest.mark.parametrize(
    "check,name",
    [
        (lambda: limits.check_prompt(LIMITS, "ok \ud800", [], "prompt[1]"), r"prompt\[1\]"),
        (lambda: limits.check_text(LIMITS, "\udfff"), "the text"),
        (lambda: limits.check_stops(LIMITS, ["fine", "\ud800"], []), "stop string 1"),
        (lambda: limits.check_ids(LIMITS, request_id="r\ud800"), "request_id"),
    ],
)
def test_a_lone_surrogate_is_refused_by_name(check, name):
    with pytest.raises(ValueError, match=f"{name} holds a lone UTF-16 surrogate"):
        check()
    limits.check_prompt(LIMITS, "a pair: \U0001f600", [])  # a surrogate pair in JSON is one character here


def output(token_ids, text, finish_reason=None):
    return RequestOutput("h", None, [1, 2], [CompletionOutput(0, text, token_ids, finish_reason)])


def test_a_stream_holds_one_message_that_grows_while_its_client_is_behind():
    stream = RequestStream("req#0", "req", SamplingParams(max_tokens=50), num_prompt_tokens=2)
    tokens, text = [], ""
    for i in range(50):
        tokens, text = tokens + [i], text + f"w{i} "
        stream.put(stream.delta_from(output(tokens, text, "length" if i == 49 else None)))
    message = stream.take(timeout=1)
    assert message.token_ids == list(range(50)) and message.text == text and message.finish_reason == "length"
    assert stream.take(timeout=0.01) is None
    stream.put(Delta([99], "late", None, None, 2, 0))  # after the last message: dropped
    assert stream.take(timeout=0.01) is None


def test_a_stream_stuck_handing_over_a_message_expires():
    stream = RequestStream("req#1", "req", SamplingParams(), num_prompt_tokens=2)
    cancelled = []
    stream.on_expire = lambda: cancelled.append(True)
    stream.put(Delta([5], "a", None, None, 2, 0))
    messages = iter(stream)
    next(messages)  # handed to the client, which does not take it
    now = time.monotonic()
    assert not stream.is_stuck(now, 30.0) and stream.is_stuck(now + 31, 30.0)
    stream.expire()
    assert cancelled and stream.expired and stream.finished


def test_the_client_refuses_two_guides_rather_than_keeping_the_last():
    from jaxserve.client_requests import build_sampling

    with pytest.raises(ValueError, match=r"at most one of .* got \['guided_regex', 'guided_choice'\]"):
        build_sampling(guided_regex="[a-z]+", guided_choice=["a", "b"])
    assert build_sampling(guided_choice=["a", "b"]).guided_decoding.WhichOneof("kind") == "choice"
