"""Prompt logprobs over the wire: OpenAI completions' echo + logprobs (max_tokens 0 and 1, streamed and not,
as lm-evaluation-harness's local-completions sends them), gRPC's prompt_logprobs and prompt_only, and
/tokenizer_info; and lm-eval itself run to the end against the server on the tiny tasks in bench/eval."""

import json
import os

import pytest

from jaxserve import SamplingParams
from jaxserve.client import Client
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.http_api import delta_from_response
from jaxserve.server.request_stream import Delta
from jaxserve.server.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
from jaxserve.server.service import response_from_delta
from tests.support.fixtures import expected
from tests.support.openai_harness import CHAT_TEMPLATE, http, sse_events
from tests.support.server_harness import ServerProcess

HF_TOLERANCE = 1e-3
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVAL_TASKS = os.path.join(ROOT, "bench", "eval")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("prompt_logprobs"), engine={"max_num_seqs": 8}, server={"chat_template": CHAT_TEMPLATE}
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


def complete(server, **body) -> dict:
    status, _, raw = http(server, "POST", "/v1/completions", {"model": "llama_gqa", "temperature": 0.0, **body})
    assert status == 200, raw
    return json.loads(raw)


def tokenize(server, text: str) -> list[int]:
    status, _, raw = http(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, raw
    return json.loads(raw)["tokens"]


def fixture_prompts() -> list[dict]:
    return [p for p in expected("llama_gqa")["prompts"] if len(p["token_ids"]) > 1]


def test_echo_with_max_tokens_zero_scores_the_prompt(server):
    prompts = fixture_prompts()
    token_ids = [p["token_ids"] + p["greedy_token_ids"][:1] for p in prompts]
    reply = complete(server, prompt=token_ids, echo=True, logprobs=3, max_tokens=0)
    assert reply["usage"]["completion_tokens"] == 0
    for choice, prompt, ids in zip(reply["choices"], prompts, token_ids):
        logprobs = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        # keyed by token text, where tokens that decode alike share an entry (as OpenAI and vLLM)
        assert all(1 <= len(top) <= 4 for top in logprobs["top_logprobs"][1:])
        # the last prompt token is transformers' first greedy token: its logprob is transformers' top one
        assert logprobs["token_logprobs"][-1] == pytest.approx(prompt["first_top_logprobs"][0], abs=HF_TOLERANCE)
        assert max(logprobs["top_logprobs"][-1].values()) == pytest.approx(logprobs["token_logprobs"][-1], abs=1e-6)


def test_lm_eval_loglikelihood_request(server):
    # as local-completions sends it: echo, logprobs 1, max_tokens 1, then token_logprobs[ctxlen:-1]
    context, continuation = [1, 290, 281, 305, 279], [266, 318, 296]
    scored = complete(server, prompt=[context + continuation], echo=True, logprobs=1, max_tokens=1, seed=1234)
    reference = complete(server, prompt=context + continuation, echo=True, logprobs=1, max_tokens=0)
    choice = scored["choices"][0]["logprobs"]
    assert len(choice["token_logprobs"]) == len(context + continuation) + 1  # the generated token last
    prompt_part = reference["choices"][0]["logprobs"]["token_logprobs"]
    assert choice["token_logprobs"][: len(prompt_part)] == pytest.approx(prompt_part, abs=1e-6)
    continuation_logprobs = choice["token_logprobs"][len(context) : -1]
    assert len(continuation_logprobs) == 3 and all(v < 0 for v in continuation_logprobs)


def test_streamed_echo_carries_the_prompt_logprobs_first(server):
    prompt = "The quick brown fox"
    status, _, raw = http(
        server,
        "POST",
        "/v1/completions",
        {"model": "llama_gqa", "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, "stream": True},
    )
    assert status == 200
    chunks = [event for event in sse_events(raw) if event != "[DONE]"]
    whole = complete(server, prompt=prompt, echo=True, logprobs=2, max_tokens=0)["choices"][0]["logprobs"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(prompt)
    num_prompt_tokens = len(whole["tokens"])
    assert first["logprobs"]["tokens"][:num_prompt_tokens] == whole["tokens"]
    assert first["logprobs"]["token_logprobs"][1:num_prompt_tokens] == pytest.approx(whole["token_logprobs"][1:])
    generated = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) - num_prompt_tokens
    assert generated == 3


def test_echo_without_logprobs_and_plain_max_tokens_zero(server):
    reply = complete(server, prompt="Return a new", echo=True, max_tokens=0)
    assert reply["choices"][0]["text"] == "Return a new" and reply["choices"][0]["logprobs"] is None
    status, _, raw = http(
        server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    )
    assert status == 400 and b"max_tokens" in raw


def test_grpc_prompt_logprobs_and_prompt_only(server):
    prompt = fixture_prompts()[4]
    token_ids = prompt["token_ids"] + prompt["greedy_token_ids"][:1]
    client = Client(server.target)
    try:
        scored = client.generate(token_ids, prompt_logprobs=2, prompt_only=True)
        plain = client.generate(token_ids, max_tokens=2, temperature=0.0)
    finally:
        client.close()
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert len(scored.prompt_logprobs) == len(token_ids) - 1
    last = scored.prompt_logprobs[-1]
    assert last[token_ids[-1]] == pytest.approx(prompt["first_top_logprobs"][0], abs=HF_TOLERANCE)
    assert plain.prompt_logprobs == [] and len(plain.token_ids) == 2


def test_tokenizer_info_for_remote_tokenizers(server):
    status, _, raw = http(server, "GET", "/tokenizer_info")
    info = json.loads(raw)
    assert status == 200 and info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["model_max_length"] == 128


def test_lm_eval_runs_both_kinds_of_task_to_the_end(server):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"http://127.0.0.1:{server.http_port}/v1/completions",
            "model": "llama_gqa",
            "num_concurrent": 4,
            "max_retries": 1,
            "max_length": 128,
        },
        tasks=["jaxserve_tiny_mc", "jaxserve_tiny_qa"],
        task_manager=TaskManager(include_path=EVAL_TASKS),
        limit=6,
        log_samples=True,
    )
    mc, qa = results["samples"]["jaxserve_tiny_mc"], results["samples"]["jaxserve_tiny_qa"]
    assert len(mc) == len(qa) == 6
    assert 0 <= results["results"]["jaxserve_tiny_mc"]["acc,none"] <= 1
    # each choice's loglikelihood is the sum of its tokens' logprobs: the server's own scoring of the text
    for sample in mc[:2]:
        for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], sample["filtered_resps"]):
            whole = tokenize(server, context + continuation)  # as lm-eval splits a pair: no BOS
            scored = complete(server, prompt=whole, echo=True, logprobs=0, max_tokens=0)
            token_logprobs = scored["choices"][0]["logprobs"]["token_logprobs"]
            assert loglikelihood == pytest.approx(sum(token_logprobs[len(tokenize(server, context)) :]), abs=1e-4)
    # generate_until: the greedy text up to the stop, as the server answers it
    first = qa[0]
    question = first["arguments"][0][0]
    reply = complete(server, prompt=tokenize(server, question), max_tokens=8, stop=["\n", "Question:"])
    assert first["resps"][0][0] == reply["choices"][0]["text"]


def test_sampling_params_cross_the_proto_and_back():
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0)
    sampling = sampling_params_to_proto(params)
    assert sampling.prompt_only and sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs == 0
    back = sampling_params_from_proto(sampling)
    assert back.max_tokens == 0 and back.prompt_logprobs == 0
    plain = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(max_tokens=3)))
    assert plain.prompt_logprobs is None and plain.max_tokens == 3
    assert sampling_params_from_proto(pb.SamplingParams()).max_tokens == 16  # 0 still means the default


def test_router_rebuilds_prompt_logprobs_from_replica_messages():
    delta = Delta(
        [], "", None, "length", 3, 0, prompt_token_ids=[1, 7, 9], prompt_logprobs=[None, {7: -1.0, 4: -0.5}, {9: -2.0}]
    )
    rebuilt = delta_from_response(response_from_delta(delta, "r"))
    assert rebuilt.prompt_logprobs == delta.prompt_logprobs


def test_vllm_prompt_logprobs_field_on_completions_and_chat(server):
    """vLLM's `prompt_logprobs` extra: per prompt token (None first) {id: {logprob, rank, decoded_token}} for the token
    and its k most likely alternatives; ranks and values as the gRPC stream gives them; refused when streamed."""
    prompt = fixture_prompts()[3]
    token_ids = prompt["token_ids"]
    client = Client(server.target)
    try:
        grpc_scored = client.stream(token_ids, prompt_logprobs=2, prompt_only=True)
        by_position = [entry for message in grpc_scored for entry in message.prompt_logprobs]
    finally:
        client.close()
    reply = complete(server, prompt=token_ids, max_tokens=1, prompt_logprobs=2, echo=True, logprobs=4)
    choice = reply["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(token_ids) == len(by_position) + 1
    for position, (entry, wire) in enumerate(zip(entries[1:], by_position), start=1):
        token = token_ids[position]
        ranks = {int(t): v["rank"] for t, v in entry.items()}
        assert {r for t, r in ranks.items() if r <= 2} == {1, 2} and ranks[token] == wire.rank >= 1
        assert len(entry) == 2 + (ranks[token] > 2)
        assert entry[str(token)]["logprob"] == pytest.approx(wire.logprob, abs=1e-6)
        assert entry[str(token)]["decoded_token"] == choice["logprobs"]["tokens"][position]
    # echo's own logprobs keep their 4 alternatives though the engine scored once for both
    assert all(len(top) >= 4 for top in choice["logprobs"]["top_logprobs"][1:])
    chat = http(
        server,
        "POST",
        "/v1/chat/completions",
        {"model": "llama_gqa", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    )
    assert chat[0] == 200, chat[2]
    chat_entries = json.loads(chat[2])["prompt_logprobs"]
    assert chat_entries[0] is None and all(
        len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_entries[1:]
    )
    status, _, raw = http(
        server, "POST", "/v1/completions", {"model": "llama_gqa", "prompt": "x", "prompt_logprobs": 1, "stream": True}
    )
    assert status == 400 and b"stream" in raw
