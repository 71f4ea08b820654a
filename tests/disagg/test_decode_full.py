"""A decode replica with one sequence slot and three handovers at once, per `disagg.when_decode_full`, in
real `jaxserve.serve` processes on loopback (one prefill replica, one decode replica per policy): "queue"
hands every request over once the slot frees; "prefill_here" runs the ones that found it full on the
decode replica and counts them. Either way the outputs are the greedy ones and no page stays held."""

import threading
import time

import grpc
import pytest

from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.launcher import LaunchedReplica, is_serving
from tests.support.fixtures import expected, fixture_dir

ENGINE = (
    "model.dtype=float32",
    "engine.max_model_len=128",
    "engine.max_num_batched_tokens=64",
    "engine.page_size=8",
    "engine.num_pages=48",
    "engine.show_progress=false",
    "engine.handover_timeout=15",
    "server.http_port=0",
)
REPLICAS = {  # name: (role, policy, max_num_seqs)
    "prefill": ("prefill", "queue", 4),
    "queue": ("decode", "queue", 1),
    "prefill_here": ("decode", "prefill_here", 1),
}
STARTUP_TIMEOUT = 300.0
NUM_REQUESTS = 3


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("replicas"))
    launched = {
        name: LaunchedReplica(
            index,
            fixture_dir("llama_gqa"),
            None,
            # one decode bucket of max_num_seqs rows: the prefill side compiles 4 rows, not 1 and 4
            ENGINE
            + (f"engine.role={role}", f"disagg.when_decode_full={policy}")
            + (f"engine.max_num_seqs={slots}", f"engine.decode_seq_buckets=[{slots}]"),
            log_dir,
        )
        for index, (name, (role, policy, slots)) in enumerate(REPLICAS.items())
    }
    try:
        for replica in launched.values():
            replica.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for replica in launched.values():
            while not is_serving(replica.address):
                assert replica.process.poll() is None and time.monotonic() < deadline, replica.log_tail()
                time.sleep(0.2)
        yield launched
    finally:
        for replica in launched.values():
            replica.stop(timeout=10)


def status(address: str) -> dpb.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        return disagg_pb2_grpc.DecodeStub(channel).Status(dpb.StatusRequest(), timeout=30)


@pytest.mark.parametrize("policy", ["queue", "prefill_here"])
def test_a_full_decode_replica_queues_or_prefills_by_its_config(replicas, policy):
    prefill, decode = replicas["prefill"], replicas[policy]
    jobs = expected("llama_gqa")["prompts"][:NUM_REQUESTS]
    before = status(decode.address)
    outputs: dict[int, list[int]] = {}
    errors: list[str] = []

    def generate(index: int, stub) -> None:
        request = dpb.DecodeRequest(
            prefill_address=prefill.address,
            request=pb.GenerateRequest(
                token_ids=jobs[index]["token_ids"], sampling=pb.SamplingParams(max_tokens=24, temperature=0.0)
            ),
        )
        try:
            outputs[index] = [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]
        except grpc.RpcError as error:
            errors.append(f"{error.code().name}: {error.details()}")

    with grpc.insecure_channel(decode.address) as channel:
        stub = disagg_pb2_grpc.DecodeStub(channel)
        # sent together: the first takes the one slot (a reservation holds it), the others find none free
        threads = [threading.Thread(target=generate, args=(index, stub)) for index in range(NUM_REQUESTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    assert [outputs[index] for index in range(NUM_REQUESTS)] == [job["greedy_token_ids"] for job in jobs]
    after = status(decode.address)
    handovers = after.num_handovers - before.num_handovers
    local = after.num_local_prefills - before.num_local_prefills
    assert handovers + local == NUM_REQUESTS and after.num_recomputed == before.num_recomputed
    if policy == "queue":
        assert (handovers, local) == (NUM_REQUESTS, 0)
    else:  # only the first found the slot free
        assert (handovers, local) == (1, NUM_REQUESTS - 1)
    assert after.num_queued == after.num_reservations == 0 and after.num_free_pages == after.num_pages
    assert status(prefill.address).num_parked == 0
