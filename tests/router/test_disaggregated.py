"""The router's disaggregated mode across processes: it launches one prefill replica and two decode
replicas (real `python -m jaxserve.serve` processes, loopback, free ports). Greedy outputs through
router -> prefill -> decode equal transformers'; both decode replicas share the prefill replica; only
the pages a decode replica lacks travel; a handover nobody takes is freed by the prefill side's
timeout; the prefill replica killed mid-handover -> the decode replica recomputes, nothing leaks; a
decode replica killed mid-stream -> the router sends the rest again and the client's answer is whole.
Every wait is bounded; the router stops every process it started."""

import os
import signal
import threading
import time

import grpc
import pytest

from jaxserve.client import Client
from jaxserve.models.kv_pages import KVPages
from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc, jaxserve_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.config import parse_config
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from tests.support.fixtures import expected, fixture_dir

PAGE_SIZE = 8
REPLICA_ENGINE = [
    "model.dtype=float32",
    "engine.max_model_len=256",
    "engine.max_num_seqs=4",
    "engine.max_num_batched_tokens=64",
    f"engine.page_size={PAGE_SIZE}",
    "engine.num_pages=96",
    "engine.show_progress=false",
    "engine.handover_timeout=15",
    "server.drain_timeout=5",
]
GREEDY = pb.SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    config = parse_config(
        {
            "model": {"path": fixture_dir("llama_gqa")},
            "router": {
                "port": 0,
                "http_port": free_port(),
                "mode": "disaggregated",
                "heartbeat": 0.2,
                "health_interval": 0.5,
                "startup_timeout": 300,
                "resend_wait": 120,
            },
            "launch": {
                "num_prefill_replicas": 1,
                "num_decode_replicas": 2,
                "set": REPLICA_ENGINE,
                "log_dir": str(tmp_path_factory.mktemp("replicas")),
            },
        }
    )
    server = RouterServer(config)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        assert all(launched.has_exited() for launched in server.launched)


def prefill_of(router):
    return router.launched[0]


def decodes_of(router):
    return router.launched[1:]


def status(address: str) -> dpb.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        return disagg_pb2_grpc.PrefillStub(channel).Status(dpb.StatusRequest(), timeout=30)


def decode_generate(address: str, prefill_address: str, token_ids, sampling=GREEDY) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        request = dpb.DecodeRequest(
            request=pb.GenerateRequest(token_ids=token_ids, sampling=sampling), prefill_address=prefill_address
        )
        return [t for m in disagg_pb2_grpc.DecodeStub(channel).Generate(request, timeout=120) for t in m.token_ids]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def nothing_held(address: str) -> bool:
    reply = status(address)
    return reply.num_free_pages == reply.num_pages and reply.num_parked == 0 and reply.num_reservations == 0


def assert_nothing_leaked(router) -> None:
    for replica in router.launched:
        wait_for(
            lambda replica=replica: nothing_held(replica.address), f"{replica.address} to free every page", timeout=30
        )


def test_greedy_outputs_through_the_router_equal_transformers(router):
    client = Client(f"127.0.0.1:{router.port}")
    for job in expected("llama_gqa")["prompts"]:
        messages = list(client.stream(job["token_ids"], max_tokens=24, temperature=0.0))
        assert [t for m in messages for t in m.token_ids] == job["greedy_token_ids"]
        assert messages[-1].finish_reason in ("length", "stop")
    client.close()
    decodes = [status(replica.address) for replica in decodes_of(router)]
    assert sum(d.num_handovers for d in decodes) > 0 and sum(d.bytes_moved for d in decodes) > 0
    assert all(d.num_recomputed == 0 and d.num_compiles_after_warmup == 0 for d in decodes)
    assert status(prefill_of(router).address).num_compiles_after_warmup == 0
    assert_nothing_leaked(router)


def test_the_openai_http_api_is_disaggregated_too(router):
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.config.router.http_port}/v1", api_key="-", max_retries=0, timeout=120
    )
    job = expected("llama_gqa")["prompts"][2]
    before = sum(status(replica.address).num_handovers for replica in decodes_of(router))
    completion = client.completions.create(model="llama_gqa", prompt=job["token_ids"], max_tokens=24, temperature=0.0)
    streamed = client.completions.create(
        model="llama_gqa", prompt=job["token_ids"], max_tokens=24, temperature=0.0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == completion.choices[0].text
    assert completion.usage.completion_tokens == len(job["greedy_token_ids"])
    assert sum(status(replica.address).num_handovers for replica in decodes_of(router)) == before + 2


def test_a_truncated_prompt_longer_than_max_model_len_is_disaggregated(router):
    """truncate_prompt_tokens: a token-id prompt longer than max_model_len (256) is accepted by the router and the
    decode replica, handed over and generated as its last k tokens alone (both refused it as too long)."""
    client = Client(f"127.0.0.1:{router.port}")
    prompt = [1] + [150 + number % 40 for number in range(299)]
    try:
        alone = client.generate(prompt[-8:], max_tokens=12, temperature=0.0, ignore_eos=True)
        cut = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=8)
    finally:
        client.close()
    assert cut.token_ids == alone.token_ids and cut.num_prompt_tokens == 8
    assert_nothing_leaked(router)


def test_two_decode_replicas_share_one_prefill_replica(router):
    prefill = prefill_of(router).address
    jobs = expected("llama_gqa")["prompts"][:4]
    before = [status(replica.address).num_handovers for replica in decodes_of(router)]
    results = {}

    def run(index, job):
        replica = decodes_of(router)[index % 2]
        results[index] = decode_generate(replica.address, prefill, job["token_ids"])

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert [results.get(i) for i in range(len(jobs))] == [job["greedy_token_ids"] for job in jobs]
    after = [status(replica.address).num_handovers for replica in decodes_of(router)]
    assert [a - b for a, b in zip(after, before)] == [2, 2]
    assert_nothing_leaked(router)


def test_only_the_pages_the_decode_replica_lacks_travel(router):
    prefill, decode = prefill_of(router).address, decodes_of(router)[0].address
    shared = [1] + list(range(40, 71))  # 32 tokens: 4 full pages
    decode_generate(decode, "", shared + [7, 8, 9])  # the decode replica computes the shared prefix itself
    before, prefill_before = status(decode), status(prefill)
    prompt = shared + list(range(200, 221))  # 53 tokens: 7 pages, the first 4 held
    assert decode_generate(decode, prefill, prompt) == decode_generate(decodes_of(router)[1].address, "", prompt)
    after, prefill_after = status(decode), status(prefill)
    page_bytes = KVPages.bytes_per_page(2, PAGE_SIZE, 2, 16, "float32")  # llama_gqa: 2 layers, 2 KV heads of 16
    assert after.num_pages_reused - before.num_pages_reused == 4
    assert after.num_pages_moved - before.num_pages_moved == 3
    assert after.bytes_moved - before.bytes_moved == 3 * page_bytes
    assert prefill_after.bytes_moved - prefill_before.bytes_moved == 3 * page_bytes
    assert_nothing_leaked(router)


def test_a_handover_nobody_takes_is_freed_by_the_prefill_side(router):
    prefill = prefill_of(router).address
    with grpc.insecure_channel(prefill) as channel:
        reply = disagg_pb2_grpc.PrefillStub(channel).Prefill(
            dpb.PrefillRequest(token_ids=list(range(3, 40)), sampling=GREEDY), timeout=60
        )
    assert reply.handover_id and reply.num_pages_sent == 5
    held = status(prefill)
    assert held.num_parked == 1 and held.num_free_pages < held.num_pages
    expired = held.num_expired
    wait_for(lambda: status(prefill).num_expired == expired + 1, "the handover to time out", timeout=60)
    assert nothing_held(prefill)


def test_a_prefill_replica_refuses_whole_requests(router):
    client = Client(prefill_of(router).address)
    with pytest.raises(grpc.RpcError) as error:
        client.generate([1, 5, 6], max_tokens=4)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "engine.role prefill" in error.value.details()
    client.close()


def test_prefill_replica_killed_mid_handover_request_completes(router):
    victim, decode = prefill_of(router), decodes_of(router)[0].address
    prompt = [1] + list(range(300, 340))
    reference = decode_generate(decodes_of(router)[1].address, "", prompt)
    recomputed = status(decode).num_recomputed
    os.kill(victim.process.pid, signal.SIGSTOP)  # it accepts the Prefill call but never answers
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("tokens", decode_generate(decode, victim.address, prompt))
    )
    try:
        thread.start()
        wait_for(lambda: status(decode).num_reservations == 1, "the decode replica to reserve pages and wait")
    finally:
        victim.process.kill()
    thread.join(timeout=120)
    assert result["tokens"] == reference
    assert status(decode).num_recomputed == recomputed + 1
    wait_for(lambda: nothing_held(decode), "the decode replica to free every page", timeout=30)


def test_decode_replica_killed_mid_stream_the_router_resends(router):
    client = Client(f"127.0.0.1:{router.port}")
    prompt = [1] + list(range(150, 160))
    wait_for(lambda: all(replica.is_up for replica in router.replicas), "every replica up", timeout=240)
    reference = client.generate(prompt, max_tokens=200, temperature=0.0, ignore_eos=True).token_ids
    tokens, victim = [], None
    for message in client.stream(prompt, max_tokens=200, temperature=0.0, ignore_eos=True):
        if victim is None:  # the decode replica running it: freeze it, then kill it
            victim = next(r for r in decodes_of(router) if running(r.address))
            os.kill(victim.process.pid, signal.SIGSTOP)
            victim.process.kill()
        tokens += message.token_ids
    client.close()
    assert tokens == reference and len(tokens) == 200
    assert sum(router.metrics.resends.labels(code)._value.get() for code in ("UNAVAILABLE", "CANCELLED")) > 0
    for survivor in (prefill_of(router), *(r for r in decodes_of(router) if r is not victim)):
        wait_for(
            lambda survivor=survivor: nothing_held(survivor.address),
            f"{survivor.address} to free every page",
            timeout=30,
        )


def running(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        info = jaxserve_pb2_grpc.GenerationStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=10)
    return info.num_running > 0
