"""The OpenAI HTTP API of a live server, through the real openai client: completions and chat, streamed
and not, n choices, logprobs, usage, prompt forms, the side routes, and a client that leaves mid-stream."""

import dataclasses
import json
import time
from http.client import HTTPConnection

import pytest

from jaxserve import SamplingParams
from jaxserve.client import Client, build_request
from jaxserve.server.fingerprint import system_fingerprint
from jaxserve.server.openai.context import INLINE_ADMISSION_BYTES
from tests.support.fixtures import expected
from tests.support.openai_harness import CHAT_TEMPLATE, http, openai_client, sse_events
from tests.support.server_harness import ServerProcess

PROMPT = "def forward(self, x):"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Return a new dict"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("openai"), engine={"max_num_seqs": 8}, server={"chat_template": CHAT_TEMPLATE}
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as client:
        yield client


def test_models_health_metrics_and_fingerprint(server, client):
    assert [model.id for model in client.models.list().data] == ["llama_gqa"]
    assert http(server, "GET", "/health")[0] == 200
    status, headers, body = http(server, "GET", "/metrics")
    assert status == 200 and b"jaxserve_kv_pages_used" in body and headers["content-type"].startswith("text/plain")
    fingerprint = Client(server.target).server_info().system_fingerprint
    completion = client.completions.create(model="llama_gqa", prompt=PROMPT, max_tokens=2, temperature=0.0)
    assert fingerprint.startswith("fp_") and completion.system_fingerprint == fingerprint


def test_streamed_completion_concatenates_to_the_unstreamed_one(server, client):
    options = dict(
        model="llama_gqa", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=11, extra_body={"return_token_ids": True}
    )
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    *deltas, last = chunks
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    token_ids = [t for c in deltas for t in c.choices[0].token_ids]
    assert token_ids == whole.choices[0].token_ids and len(token_ids) == 20
    assert deltas[-1].choices[0].finish_reason == "length" and all(
        c.choices[0].finish_reason is None for c in deltas[:-1]
    )
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    num_prompt_tokens = json.loads(http(server, "POST", "/tokenize", {"prompt": PROMPT})[2])["count"]
    usage = whole.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        num_prompt_tokens,
        20,
        num_prompt_tokens + 20,
    )
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_greedy_batch_of_token_id_prompts_equals_the_recorded_output(client):
    prompts = expected("llama_gqa")["prompts"]
    completion = client.completions.create(
        model="llama_gqa",
        prompt=[p["token_ids"] for p in prompts],
        max_tokens=24,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in completion.choices] == list(range(len(prompts)))
    for choice, prompt in zip(completion.choices, prompts):
        assert choice.token_ids == prompt["greedy_token_ids"]
    assert completion.usage.prompt_tokens == sum(len(p["token_ids"]) for p in prompts)
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in completion.choices)


def test_n_choices_per_prompt_in_order(client):
    completion = client.completions.create(
        model="llama_gqa",
        prompt=[PROMPT, "Return a new"],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in completion.choices] == list(range(6))
    for choice in completion.choices:
        assert choice.text.startswith(PROMPT if choice.index < 3 else "Return a new")
    assert len({tuple(c.token_ids) for c in completion.choices[:3]}) > 1, "n samples differ"
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in completion.choices) == 36


def test_stop_strings_and_completion_logprobs(client):
    full = client.completions.create(model="llama_gqa", prompt=PROMPT, max_tokens=12, temperature=0.0)
    text = full.choices[0].text
    stop = text[3:5]
    stopped = client.completions.create(model="llama_gqa", prompt=PROMPT, max_tokens=12, temperature=0.0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].stop_reason == stop
    kept = client.completions.create(
        model="llama_gqa",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == stopped.choices[0].text + stop
    assert full.choices[0].stop_reason is None  # vLLM's: set only by a stop string or stop token
    token = client.completions.create(
        model="llama_gqa", prompt=[1, 5, 9], max_tokens=4, temperature=0.0, extra_body={"return_token_ids": True}
    ).choices[0]
    by_token = client.completions.create(
        model="llama_gqa",
        prompt=[1, 5, 9],
        max_tokens=4,
        temperature=0.0,
        extra_body={"stop_token_ids": [token.token_ids[1]]},
    ).choices[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token.token_ids[1]
    scored = client.completions.create(model="llama_gqa", prompt=[1, 5, 9], max_tokens=3, temperature=0.0, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert all(v <= 0 for v in logprobs.token_logprobs) and all(len(top) >= 2 for top in logprobs.top_logprobs)


def test_chat_streamed_equals_unstreamed_and_offline(client, llama_llm):
    options = dict(
        model="llama_gqa", messages=CONVERSATION, max_tokens=10, temperature=0.0, extra_body={"return_token_ids": True}
    )
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    assert chunks[0].choices[0].delta.role == "assistant"
    *deltas, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 10 == whole.usage.completion_tokens
    offline = llama_llm.chat(CONVERSATION, SamplingParams(max_tokens=10, temperature=0.0), chat_template=CHAT_TEMPLATE)[
        0
    ]
    assert whole.choices[0].token_ids == offline.outputs[0].token_ids
    assert whole.choices[0].message.content == offline.outputs[0].text
    assert whole.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_chat_echo_leads_the_continued_assistant_message(client):
    """vLLM's chat echo: continuing an assistant turn, each reply starts with that turn's text (its own chunk when
    streamed); the generated part is what it is without echo."""
    started = {"role": "assistant", "content": "Sure, here"}
    options = dict(
        model="llama_gqa",
        messages=[*CONVERSATION, started],
        max_tokens=6,
        temperature=0.0,
        n=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    plain = client.chat.completions.create(**options)
    echoed = client.chat.completions.create(**{**options, "extra_body": echoed_body(options)})
    for without, with_echo in zip(plain.choices, echoed.choices):
        assert with_echo.message.content == "Sure, here" + without.message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # echo adds text, not tokens
    chunks = list(client.chat.completions.create(stream=True, **{**options, "extra_body": echoed_body(options)}))
    for index, choice in enumerate(echoed.choices):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].role == "assistant" and deltas[1].content == "Sure, here"
        assert "".join(d.content or "" for d in deltas) == choice.message.content


def echoed_body(options: dict) -> dict:
    return {**options["extra_body"], "echo": True}


def test_chat_n_with_logprobs_and_seed(client):
    options = dict(
        model="llama_gqa",
        messages=CONVERSATION,
        max_completion_tokens=5,
        n=3,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    first, again = client.chat.completions.create(**options), client.chat.completions.create(**options)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices], "seeded: repeatable"
    for choice in first.choices:
        content = choice.logprobs.content
        assert len(content) == len(choice.token_ids) == 5
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in content)
    assert first.usage.completion_tokens == 15


def test_tokenize_and_detokenize(server):
    grpc_ids = Client(server.target).tokenize("Return a new dictionary")
    status, _, body = http(server, "POST", "/tokenize", {"prompt": "Return a new dictionary"})
    assert status == 200 and json.loads(body)["tokens"] == grpc_ids
    _, _, body = http(server, "POST", "/tokenize", {"messages": CONVERSATION})
    assert json.loads(body)["count"] == len(json.loads(body)["tokens"]) > len(grpc_ids)
    _, _, body = http(server, "POST", "/detokenize", {"tokens": grpc_ids})
    assert json.loads(body)["prompt"] == "Return a new dictionary"


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    aborted = 'jaxserve_requests_total{finish_reason="abort"}'
    aborted_before = server.metric(aborted, default=0.0)
    connection = HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {"prompt": [1] + [7] * 20, "max_tokens": 100, "temperature": 0.0, "ignore_eos": True, "stream": True}
        ),
        {"Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()  # mid-stream: about 100 tokens are still to come
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.metric(aborted, default=0.0) > aborted_before and server.metric("jaxserve_kv_pages_used") == 0:
            break
        time.sleep(0.05)
    assert server.metric(aborted) > aborted_before and server.metric("jaxserve_kv_pages_used") == 0
    info = Client(server.target).server_info()
    assert info.num_free_pages == info.num_pages and info.num_running == 0


def test_n_over_grpc_equals_n_over_http_and_offline(server, client, llama_llm):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=21)
    offline = [o.token_ids for o in llama_llm.generate([[1, 5, 9]], params)[0].outputs]
    over_http = client.completions.create(
        model="llama_gqa",
        prompt=[1, 5, 9],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=21,
        extra_body={"return_token_ids": True},
    )
    request = build_request([1, 5, 9], max_tokens=6, temperature=1.0, seed=21)
    request.sampling.n = 3
    over_grpc = [[], [], []]
    for message in Client(server.target).stub.Generate(request):
        over_grpc[message.index] += message.token_ids
    assert [c.token_ids for c in over_http.choices] == over_grpc == offline and len(set(map(tuple, offline))) > 1
    client_side = Client(server.target)
    completions = client_side.generate_n([1, 5, 9], n=3, max_tokens=6, temperature=1.0, seed=21, prompt_logprobs=1)
    assert [c.token_ids for c in completions] == offline and [c.index for c in completions] == [0, 1, 2]
    # each completion the prompt's two scores (Completion.add concatenated all n completions' into one)
    assert [c.prompt_logprobs for c in completions] == [completions[0].prompt_logprobs] * 3
    assert len(completions[0].prompt_logprobs) == 2
    with pytest.raises(ValueError, match="generate_n returns them"):
        client_side.generate([1, 5, 9], n=3, max_tokens=6)
    client_side.close()


def test_system_fingerprint_follows_the_serving_configuration(llama_llm):
    description = llama_llm.engine.describe()
    fingerprint = system_fingerprint(description)
    assert fingerprint == system_fingerprint(llama_llm.engine.describe())
    for change in (
        dict(model_fingerprint="another checkpoint"),
        dict(dtype="bfloat16"),
        dict(mesh="tensor 2 over 2 cpu devices"),
        dict(compiled_buckets=description.compiled_buckets[:-1]),
    ):
        assert system_fingerprint(dataclasses.replace(description, **change)) != fingerprint, change


def test_a_large_request_is_admitted_off_the_event_loop_alike(server):
    body = {"model": "llama_gqa", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    small = json.loads(http(server, "POST", "/v1/completions", body)[2])
    padded = json.dumps(body, separators=(",", ":" + " " * 5000)).encode()  # over INLINE_ADMISSION_BYTES
    assert len(padded) > INLINE_ADMISSION_BYTES
    status, _, answer = http(server, "POST", "/v1/completions", raw=padded)
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["token_ids"] == small["choices"][0]["token_ids"]


def test_a_streamed_chat_ends_with_its_stop_reason(server):
    body = {"model": "llama_gqa", "messages": CONVERSATION, "max_tokens": 8, "temperature": 0.0}
    status, _, raw = http(server, "POST", "/v1/chat/completions", {**body, "return_token_ids": True})
    assert status == 200, raw
    stop_token = json.loads(raw)["choices"][0]["token_ids"][2]
    status, _, raw = http(
        server, "POST", "/v1/chat/completions", {**body, "stream": True, "stop_token_ids": [stop_token]}
    )
    assert status == 200, raw
    finished = [c for e in sse_events(raw) if e != "[DONE]" for c in e["choices"] if c["finish_reason"] is not None]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finished] == [("stop", stop_token)]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client):
    """vLLM's truncate_prompt_tokens: completions (text and token ids, echo with logprobs), chat (the rendered
    conversation's last tokens) and gRPC use only the prompt's last k tokens; 0, -2 and more than max_model_len
    are refused."""
    ids = [1, 275, 240, 302, 123, 94, 304, 336, 40, 41, 42, 43]
    options = dict(model="llama_gqa", max_tokens=8, temperature=0.0)
    short = client.completions.create(prompt=ids[-5:], **options)
    for prompt in (ids, ids[-5:]):
        cut = client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 5}, **options)
        assert cut.choices[0].text == short.choices[0].text and cut.usage.prompt_tokens == 5
    text = client.completions.create(prompt=PROMPT * 3, **options, extra_body={"truncate_prompt_tokens": 4})
    assert text.usage.prompt_tokens == 4
    echoed = client.completions.create(
        prompt=ids, echo=True, logprobs=1, **{**options, "max_tokens": 2}, extra_body={"truncate_prompt_tokens": 5}
    )
    assert echoed.usage.prompt_tokens == 5
    assert len(echoed.choices[0].logprobs.token_logprobs) == 5 + 2  # the scored prompt is the truncated one
    whole_chat = client.chat.completions.create(messages=CONVERSATION, **options)
    chat = client.chat.completions.create(messages=CONVERSATION, **options, extra_body={"truncate_prompt_tokens": 6})
    assert chat.usage.prompt_tokens == 6 < whole_chat.usage.prompt_tokens
    over_grpc = Client(server.target).generate(ids, max_tokens=8, temperature=0.0, truncate_prompt_tokens=5)
    assert over_grpc.text == short.choices[0].text and over_grpc.num_prompt_tokens == 5
    for value in (0, -2, 10**6):
        status, _, body = http(
            server, "POST", "/v1/completions", {"model": "llama_gqa", "prompt": ids, "truncate_prompt_tokens": value}
        )
        assert status == 400 and b"truncate_prompt_tokens" in body, body


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    for create, extra in (
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": CONVERSATION}),
    ):
        chunks = list(
            create(
                model="llama_gqa",
                max_tokens=6,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                **extra,
            )
        )
        usages = [chunk.usage for chunk in chunks]
        assert all(usage is not None for usage in usages)
        assert len({usage.prompt_tokens for usage in usages}) == 1 and usages[0].prompt_tokens > 0
        completion = [usage.completion_tokens for usage in usages]
        assert completion == sorted(completion) and completion[-1] == 6
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
