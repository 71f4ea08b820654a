"""A prefill worker process and a decode engine here: pages pulled with JAX's transfer server over
loopback. Greedy outputs equal the colocated engine's; killing the worker mid-handover still completes
the request (recomputed here) and leaks no page; a client that never takes its pages leaks none there."""

import time

import pytest

from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir
from jaxserve import LLM, SamplingParams
from jaxserve.disagg.remote import RemotePrefill, start_prefill_worker

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LIMIT = 120.0  # seconds any loop below may run


@pytest.fixture()
def remote():
    process, port = start_prefill_worker(fixture_dir("llama_gqa"), SMALL_ENGINE, timeout=5.0)
    decode = LLM(fixture_dir("llama_gqa"), role="decode", **SMALL_ENGINE).engine
    client = RemotePrefill(decode, port, reply_timeout=10.0)
    yield client, process
    process.kill()
    process.wait(timeout=30)


def run_until_done(client, request_ids):
    done, deadline = {}, time.monotonic() + LIMIT
    while set(request_ids) - set(done):
        assert time.monotonic() < deadline, "requests did not finish in time"
        for output in client.step():
            if isinstance(output, dict):
                done[output["request_id"]] = output["token_ids"]
            elif output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        time.sleep(0.001)
    return done


def all_pages_free(engine):
    stats = engine.stats()
    return stats["kv_pages_free"] == stats["kv_pages_total"]


def test_greedy_outputs_equal_colocated_and_nothing_leaks(remote, llama_llm):
    client, _ = remote
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"]]
    for index, prompt in enumerate(prompts):
        client.add_request(f"r{index}", prompt, GREEDY)
    done = run_until_done(client, [f"r{i}" for i in range(len(prompts))])
    colocated = llama_llm.generate(prompts, GREEDY)
    assert [done[f"r{i}"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in colocated]
    assert client.stats.num_handovers > 0 and client.stats.bytes_moved > 0 and client.stats.num_recomputed == 0
    worker = client.worker_stats()
    assert worker["pages_free"] == worker["pages_total"] and worker["parked"] == 0
    assert all_pages_free(client.engine)


def test_worker_killed_mid_handover_request_completes(remote, llama_llm):
    client, process = remote
    prompt = list(range(3, 60))
    client.add_request("victim", prompt, GREEDY)
    original = client._hand_over

    def die_then_hand_over(prefilled):  # the worker dies after prefilling, before its pages move
        process.kill()
        process.wait(timeout=30)
        original(prefilled)

    client._hand_over = die_then_hand_over
    done = run_until_done(client, ["victim"])
    assert done["victim"] == llama_llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert client.stats.num_recomputed == 1 and not client.engine.handovers.reservations
    assert all_pages_free(client.engine)


def test_abandoned_handover_times_out_on_the_worker(remote):
    client, _ = remote
    client._hand_over = lambda prefilled: None  # the decode side never asks for the pages
    client.add_request("abandoned", list(range(3, 40)), GREEDY)
    deadline = time.monotonic() + LIMIT
    while client.in_flight and time.monotonic() < deadline:
        client.step()
        if client.backlog == [] and not client.connection.poll(0.05):
            stats = client.worker_stats()
            if stats and stats["expired"]:
                break
    stats = client.worker_stats()
    assert stats["expired"] == 1 and stats["parked"] == 0 and stats["pages_free"] == stats["pages_total"]
