"""The router in front of two replicas it launches (real `python -m jaxserve.serve` processes on free
loopback ports): forwarding, prefix routing, metrics; then a replica killed mid-run (no request lost
that had not streamed a token, streams under way end UNAVAILABLE, the router keeps serving) and
restarted by the router (used again). Every wait is bounded."""

import threading
import time

import grpc
import pytest

from jaxserve.client import Client
from jaxserve.router.config import parse_config
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from tests.support.fixtures import expected, fixture_dir

REPLICA_ENGINE = [
    "model.dtype=float32",
    "engine.max_model_len=128",
    "engine.max_num_seqs=2",
    "engine.max_num_batched_tokens=64",
    "engine.page_size=8",
    "engine.num_pages=48",
    "engine.show_progress=false",
    "server.drain_timeout=5",
]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    config = parse_config(
        {
            "model": {"path": fixture_dir("llama_gqa")},
            "router": {
                "port": 0,
                "http_port": free_port(),
                "policy": "prefix",
                "heartbeat": 0.2,
                "health_interval": 0.5,
                "startup_timeout": 240,
            },
            "launch": {"num_replicas": 2, "set": REPLICA_ENGINE, "log_dir": str(tmp_path_factory.mktemp("replicas"))},
        }
    )
    server = RouterServer(config)
    server.start()
    yield server
    server.stop()
    assert all(launched.has_exited() for launched in server.launched)


def counter(server, metric, *labels) -> float:
    return getattr(server.metrics, metric).labels(*labels)._value.get()


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_streams_through_the_router_equal_the_models_greedy_output(router):
    client = Client(f"127.0.0.1:{router.port}")
    for job in expected("llama_gqa")["prompts"][:4]:
        messages = list(client.stream(job["token_ids"], max_tokens=24, temperature=0.0))
        assert [t for m in messages for t in m.token_ids] == job["greedy_token_ids"]
        assert messages[-1].finish_reason in ("length", "stop")  # (how many messages: the replica's merging)
        if job["text"]:  # the router tokenizes text itself and forwards the ids: the same completion
            assert client.generate(job["text"], max_tokens=24, temperature=0.0).token_ids == job["greedy_token_ids"]
    client.close()


def test_a_conversation_stays_where_its_prefix_is_cached(router):
    client = Client(f"127.0.0.1:{router.port}")
    conversation = [1] + list(range(10, 50))
    before = {r.address: counter(router, "requests", r.address) for r in router.replicas}
    for turn in range(4):
        completion = client.generate(conversation, max_tokens=8, temperature=0.0, ignore_eos=True)
        if turn:
            assert completion.num_cached_tokens >= (len(conversation) - 16) // 8 * 8
        conversation += completion.token_ids + list(range(60 + turn, 70 + turn))
        time.sleep(0.3)  # as a person would: the page events arrive meanwhile
    client.close()
    gained = sorted(counter(router, "requests", r.address) - before[r.address] for r in router.replicas)
    assert gained == [0, 4]
    assert sum(counter(router, "hit_tokens", r.address) for r in router.replicas) > 0


def test_the_requests_own_errors_pass_through(router):
    client = Client(f"127.0.0.1:{router.port}")
    with pytest.raises(grpc.RpcError) as error:
        client.generate([1, 2, 3], max_tokens=500)  # beyond max_model_len: the replica says so
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        client.generate("", max_tokens=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = client.server_info()
    assert info.num_pages == 2 * 47 and info.model_fingerprint
    # oversized requests are refused as a replica refuses them: past its receive limit by gRPC, unread
    # (RESOURCE_EXHAUSTED); past the request's own cap unparsed (INVALID_ARGUMENT)
    replica = Client(router.replicas[0].address)
    for text in ("a" * 200_000, "a" * 5_000):
        codes = []
        for target in (client, replica):
            with pytest.raises(grpc.RpcError) as error:
                target.tokenize(text)
            codes.append(error.value.code())
        assert codes[0] == codes[1], (len(text), codes)
    assert codes[0] == grpc.StatusCode.INVALID_ARGUMENT
    replica.close()
    client.close()


def test_the_openai_http_api_is_routed_too(router):
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.config.router.http_port}/v1", api_key="-", max_retries=0, timeout=120
    )
    job = expected("llama_gqa")["prompts"][1]
    grpc_client = Client(f"127.0.0.1:{router.port}")
    text = grpc_client.generate(job["token_ids"], max_tokens=16, temperature=0.0).text
    grpc_client.close()
    model = client.models.list().data[0].id
    assert model == "llama_gqa"
    completion = client.completions.create(model=model, prompt=job["token_ids"], max_tokens=16, temperature=0.0)
    assert completion.choices[0].text == text and completion.usage.prompt_tokens == len(job["token_ids"])
    chunks = client.completions.create(model=model, prompt=job["text"], max_tokens=16, temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == text
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=model, prompt=job["token_ids"], max_tokens=500)


def test_sampling_controls_and_guided_json_through_the_router_equal_a_replica_direct(router):
    """The router's HTTP API forwards logit_bias, the penalties and guided_json: the completion equals the
    same request sent to a replica's gRPC API directly (replicas of one model, greedy)."""
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.config.router.http_port}/v1", api_key="-", max_retries=0, timeout=120
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    job = expected("llama_gqa")["prompts"][1]
    sampling = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3)
    direct = Client(router.launched[0].address)
    try:
        for bias, guided in (({job["greedy_token_ids"][0]: -100.0, 42: 8.0}, None), ({}, schema)):
            extra = {**sampling, **({"guided_json": guided} if guided else {})}
            routed = client.completions.create(
                model="llama_gqa",
                prompt=job["token_ids"],
                max_tokens=12,
                temperature=0.0,
                logit_bias={str(token): value for token, value in bias.items()},
                extra_body=extra,
            )
            alone = direct.generate(job["token_ids"], max_tokens=12, temperature=0.0, logit_bias=bias or None, **extra)
            assert routed.choices[0].text == alone.text
            if bias:
                assert alone.token_ids[0] == 42
            else:
                assert alone.text.startswith("{")
    finally:
        direct.close()


def run_long_requests(target: str, num_requests: int, started: list, outcomes: list) -> list[threading.Thread]:
    def run(index: int) -> None:
        client = Client(target)
        try:
            tokens = []
            for message in client.stream([1] + [100 + index] * 9, max_tokens=96, temperature=0.0, ignore_eos=True):
                if not tokens:
                    started[index] = time.monotonic()
                tokens += message.token_ids
            outcomes[index] = ("ok", len(tokens))
        except grpc.RpcError as error:
            outcomes[index] = (error.code().name, error.details())
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(num_requests)]
    for thread in threads:
        thread.start()
    return threads


def resends(router) -> float:
    """Requests the router sent again, for any reason."""
    return sum(sample.value for metric in router.metrics.resends.collect() for sample in metric.samples
               if sample.name.endswith("_total"))  # fmt: skip


def test_a_killed_replica_loses_no_unstarted_request_and_comes_back(router):
    num_requests = 8  # 2 running + 2 waiting on each replica (max_num_seqs = 2)
    started, outcomes = [None] * num_requests, [None] * num_requests
    threads = run_long_requests(f"127.0.0.1:{router.port}", num_requests, started, outcomes)

    def replica_with_a_waiting_request():
        # the router's view: a request routed there that has not streamed yet (the one a kill must not lose;
        # which replica holds one depends on the routing's timing, so the victim is chosen by it)
        waiting = {r.address for r in router.replicas if r.num_outstanding > 0}
        return next((launched for launched in router.launched if launched.address in waiting), None)

    wait_for(
        lambda: sum(s is not None for s in started) >= 3 and replica_with_a_waiting_request() is not None,
        "streams under way and one waiting on a replica",
    )
    victim, resends_before = replica_with_a_waiting_request(), resends(router)
    killed_at = time.monotonic()
    victim.process.kill()
    for thread in threads:
        thread.join(timeout=180)
        assert not thread.is_alive()
    # A first token the router forwarded just before the kill can reach the client's thread a moment after
    # it (two busy cores): such a stream was under way for the router, which may fail it. Streams that first
    # streamed well after the kill were re-sent and must complete.
    in_transit = 1.0
    for started_at, outcome in zip(started, outcomes):
        if started_at is None or started_at > killed_at + in_transit:  # had not streamed when it died: not lost
            assert outcome == ("ok", 96)
        else:
            assert outcome == ("ok", 96) or (outcome[0] == "UNAVAILABLE" and victim.address in outcome[1])
    assert any(outcome[0] == "UNAVAILABLE" for outcome in outcomes), "a stream on the killed replica was under way"
    assert resends(router) > resends_before  # the waiting request went to the other replica
    # the router keeps serving on the other replica meanwhile
    client = Client(f"127.0.0.1:{router.port}")
    assert client.generate([1, 5, 6, 7], max_tokens=4).finish_reason == "length"
    # the router starts the replica again; once it has sent a fresh snapshot, it is used again
    replica = next(r for r in router.replicas if r.address == victim.address)
    wait_for(lambda: victim.num_starts == 2 and replica.is_up, "the restarted replica", timeout=240)
    before = counter(router, "requests", victim.address)
    results = [None] * 4
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, Client(f"127.0.0.1:{router.port}").generate([1] + [200 + i] * 30, max_tokens=16).finish_reason
            )
        )
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == ["length"] * 4
    assert counter(router, "requests", victim.address) > before
    client.close()


def test_sigterm_drains_the_router_then_stops_it(router):
    """The module's last test: it stops the router. What SIGTERM runs (router/__main__.py): new requests are
    refused UNAVAILABLE (HTTP 503) at once, while every stream in flight, queued on a replica or running,
    finishes whole; then the router and its launched replicas stop."""
    import requests

    num_requests = 8  # 2 running + 2 waiting on each replica

    def routed() -> float:
        return sum(counter(router, "requests", r.address) for r in router.replicas)

    routed_before = routed()
    started, outcomes = [None] * num_requests, [None] * num_requests
    threads = run_long_requests(f"127.0.0.1:{router.port}", num_requests, started, outcomes)
    # every request routed (the drain refuses what comes later) and one streaming
    wait_for(lambda: routed() - routed_before >= num_requests, "every request at the router")
    wait_for(lambda: any(s is not None for s in started), "a stream under way")
    drainer = threading.Thread(target=router.drain_and_stop)
    drainer.start()
    wait_for(lambda: router.service.draining, "the drain")
    late = Client(f"127.0.0.1:{router.port}")
    with pytest.raises(grpc.RpcError) as error:
        late.generate([1, 5, 6, 7], max_tokens=4)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    late.close()
    http = f"http://127.0.0.1:{router.config.router.http_port}/v1/completions"
    refused = requests.post(http, json={"model": "llama_gqa", "prompt": [1, 5], "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503
    assert router.service.num_in_flight > 0  # (the refusals came while streams were still in flight)
    for thread in threads:
        thread.join(timeout=180)
        assert not thread.is_alive()
    assert outcomes == [("ok", 96)] * num_requests
    drainer.join(timeout=120)
    assert not drainer.is_alive() and all(launched.has_exited() for launched in router.launched)
