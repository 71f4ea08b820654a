"""A real server (in this process, so that the test can read its allocator) and the router's replica
follower over gRPC: after a random workload with evictions, host-tier demotions and promotions and
cancelled streams, the router's view equals the replica's cache page for page; a gap resubscribes."""

import random
import threading
import time

import grpc
import pytest

from jaxserve.client import Client
from jaxserve.host.kv_events import DEVICE, HOST
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.launcher import free_port, http_port_off
from jaxserve.router.replica import Replica
from jaxserve.serve import Server
from jaxserve.server import kv_events_service
from jaxserve.server.config_file import load_config
from tests.support.fixtures import fixture_dir

ENGINE = [
    "engine.max_model_len=128",
    "engine.max_num_seqs=4",
    "engine.max_num_batched_tokens=64",
    "engine.page_size=8",
    "engine.num_pages=24",
    "engine.swap_space=0.0005",
    "engine.show_progress=false",
]


@pytest.fixture(scope="module")
def server():
    overrides = [
        f"model.path={fixture_dir('llama_gqa')}",
        "model.dtype=float32",
        *ENGINE,
        f"server.port={free_port()}",
        "server.metrics_port=0",
        *http_port_off()[1::2],
    ]
    server = Server(load_config(None, overrides))
    server.start()
    yield server
    server.drain_and_stop()


@pytest.fixture
def follower(server):
    info = server.loop.description
    replica = Replica(
        f"127.0.0.1:{server.port}", info.model_fingerprint, blind_window=2.0, heartbeat=0.1, health_interval=0.5
    )
    replica.start()
    wait_for(lambda: replica.is_up, "the replica to come up")
    yield replica
    replica.stop()


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def cache_pages(server) -> dict:
    allocator = server.loop.engine.schedulers[0].allocator
    return {
        DEVICE: {
            key: (allocator.page_contents[page][0], len(allocator.page_contents[page][1]))
            for key, page in allocator.pages_by_key.items()
        },
        HOST: {key: (contents[0], len(contents[1])) for key, (contents, _) in allocator.host_tier.entries.items()},
    }


def view_pages(replica: Replica) -> dict:
    return {
        tier: {key: (page.parent_key, page.num_tokens) for key, page in replica.view.state.pages(0, tier).items()}
        for tier in (DEVICE, HOST)
    }


def caught_up(server, replica) -> bool:
    return (
        not server.loop.engine.has_unfinished_requests()
        and replica.view.sequence == server.loop.engine.kv_events().sequence
    )


def run_random_workload(target: str, seed: int, num_requests: int = 40) -> None:
    """Shared prefixes, multi-turn continuations, concurrent clients, some streams cancelled."""
    rng = random.Random(seed)
    systems = [[1] + [rng.randint(3, 383) for _ in range(23)] for _ in range(3)]
    prompts = [
        rng.choice(systems) + [rng.randint(3, 383) for _ in range(rng.randint(1, 40))] for _ in range(num_requests)
    ]

    def run(index: int) -> None:
        client = Client(target)
        try:
            stream = client.stream(prompts[index], max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
            for number, _ in enumerate(stream):
                if index % 7 == 0 and number == 1:
                    stream.cancel()
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED
        finally:
            client.close()

    for start in range(0, num_requests, 8):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(start, min(start + 8, num_requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive()


def test_the_view_equals_the_replicas_cache_after_a_random_workload(server, follower):
    run_random_workload(follower.address, seed=0)
    wait_for(lambda: caught_up(server, follower), "the events to arrive")
    assert view_pages(follower) == cache_pages(server)
    stats = server.loop.engine.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["swapped_out_pages"] > 0 and stats["swapped_in_pages"] > 0
    assert len(view_pages(follower)[HOST]) > 0
    # the load arrives with the events, and the measured prefill rate with it
    wait_for(
        lambda: follower.load.num_running == 0 and follower.load.num_free_pages == stats["kv_pages_free"],
        "the idle load",
    )
    assert follower.load.prefill_seconds_per_token > 0


def test_a_gap_resubscribes_and_the_view_is_whole_again(server, follower):
    snapshots = follower.num_snapshots
    follower.view.sequence -= 1  # as if an event had been lost: the next batch does not follow on
    run_random_workload(follower.address, seed=1, num_requests=8)
    wait_for(lambda: follower.num_snapshots > snapshots and caught_up(server, follower), "a resubscription")
    assert view_pages(follower) == cache_pages(server)


def test_snapshots_and_deltas_split_into_small_batches(server, monkeypatch):
    """A cache of a million pages is still a stream of small messages: here, batches of at most 3 events."""
    monkeypatch.setattr(kv_events_service, "MAX_EVENTS_PER_BATCH", 3)
    run_random_workload(f"127.0.0.1:{server.port}", seed=2, num_requests=8)  # a cache worth splitting
    wait_for(lambda: not server.loop.engine.has_unfinished_requests(), "the workload")
    client = Client(f"127.0.0.1:{server.port}")
    call = client.stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(heartbeat_ms=50))
    try:
        batches = [next(call)]
        while batches[-1].more:
            batches.append(next(call))
        assert len(batches) > 3 and batches[0].snapshot and not any(b.snapshot for b in batches[1:])
        assert all(len(b.events) <= 3 and b.sequence == batches[0].sequence for b in batches)
    finally:
        call.cancel()
        client.close()
    replica = Replica(
        f"127.0.0.1:{server.port}",
        server.loop.description.model_fingerprint,
        blind_window=2.0,
        heartbeat=0.1,
        health_interval=0.5,
    )
    replica.start()
    try:
        wait_for(lambda: replica.is_up, "the replica to come up")
        run_random_workload(replica.address, seed=3, num_requests=16)
        wait_for(lambda: caught_up(server, replica), "the events to arrive")
        assert view_pages(replica) == cache_pages(server)
    finally:
        replica.stop()


def test_a_new_subscriber_gets_a_snapshot_then_deltas(server):
    client = Client(f"127.0.0.1:{server.port}")
    call = client.stub.SubscribeKVEvents(pb.SubscribeKVEventsRequest(heartbeat_ms=50))
    try:
        first = next(call)
        assert first.snapshot and first.sequence == server.loop.engine.kv_events().sequence
        assert {event.key for event in first.events if event.tier == pb.KVEvent.DEVICE} == set(
            cache_pages(server)[DEVICE]
        )
        heartbeat = next(call)  # nothing happens: a heartbeat still comes, with the load
        assert not heartbeat.snapshot and heartbeat.sequence == first.sequence and not heartbeat.events
        assert heartbeat.load.num_free_pages == server.loop.stats["kv_pages_free"]
        assert heartbeat.instance_id == client.server_info().instance_id != ""
    finally:
        call.cancel()
        client.close()


def test_server_info_carries_what_a_router_needs(server):
    client = Client(f"127.0.0.1:{server.port}")
    info = client.server_info()
    client.close()
    assert len(info.model_fingerprint) == 32 and info.model_fingerprint == server.loop.description.model_fingerprint
    assert info.host_tier_pages > 0 and info.prefill_seconds_per_token >= 0
