"""LoRA adapters through a prefill/decode handover, in real `jaxserve.serve` processes on loopback: the
adapter is loaded with gRPC LoadLoRA on both replicas (into different slots: the decode replica holds
another adapter first), requests name it in SamplingParams.lora, and the greedy tokens equal
transformers + PEFT's. Pages are keyed by the adapter's identity on both sides: a prompt the decode
replica holds for the base model reuses none of those pages for the adapter (and vice versa), while the
same adapter's second request reuses its own."""

import time

import grpc
import pytest

from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc, jaxserve_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.launcher import LaunchedReplica, is_serving
from tests.lora.support import BASE_MODEL, adapter_dir, expected

PAGE_SIZE = 8
ENGINE = (
    "model.dtype=float32",
    "engine.max_model_len=128",
    "engine.max_num_seqs=4",
    "engine.max_num_batched_tokens=64",
    "engine.decode_seq_buckets=[4]",
    "engine.prefill_token_buckets=[64]",
    f"engine.page_size={PAGE_SIZE}",
    "engine.num_pages=48",
    "engine.show_progress=false",
    "engine.handover_timeout=15",
    "engine.max_adapters=2",
    "engine.max_rank=8",
    "server.http_port=0",
)
STARTUP_TIMEOUT = 300.0
ADAPTER = "attn_r4"
MAX_TOKENS = len(expected()["base_greedy_token_ids"][0])


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("replicas"))
    launched = {
        role: LaunchedReplica(index, BASE_MODEL, None, (*ENGINE, f"engine.role={role}"), log_dir)
        for index, role in enumerate(("prefill", "decode"))
    }
    try:
        for replica in launched.values():
            replica.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for replica in launched.values():
            while not is_serving(replica.address):
                assert replica.process.poll() is None and time.monotonic() < deadline, replica.log_tail()
                time.sleep(0.2)
        slots = {}
        for role, names in (("prefill", [ADAPTER]), ("decode", ["mixed_r3", ADAPTER])):
            with grpc.insecure_channel(launched[role].address) as channel:
                stub = jaxserve_pb2_grpc.GenerationStub(channel)
                for name in names:
                    request = pb.LoadLoRARequest(name=name, path=adapter_dir(name))
                    slots[role, name] = stub.LoadLoRA(request, timeout=60).slot
        assert slots["prefill", ADAPTER] != slots["decode", ADAPTER]  # the handover does not rely on slots
        yield launched
    finally:
        for replica in launched.values():
            replica.stop(timeout=10)


def status(address: str) -> dpb.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        return disagg_pb2_grpc.DecodeStub(channel).Status(dpb.StatusRequest(), timeout=30)


def handed_over(replicas, index: int, lora: str) -> tuple[list[int], int]:
    """Greedy tokens of prompt `index` through the handover, and how many prompt pages the decode replica
    reused from its own cache for it."""
    decode = replicas["decode"].address
    before = status(decode)
    request = dpb.DecodeRequest(
        prefill_address=replicas["prefill"].address,
        request=pb.GenerateRequest(
            token_ids=expected()["prompts"][index],
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=lora),
        ),
    )
    with grpc.insecure_channel(decode) as channel:
        tokens = [t for m in disagg_pb2_grpc.DecodeStub(channel).Generate(request, timeout=120) for t in m.token_ids]
    after = status(decode)
    assert after.num_handovers == before.num_handovers + 1 and after.num_recomputed == before.num_recomputed
    return tokens, after.num_pages_reused - before.num_pages_reused


@pytest.mark.parametrize("index, first", [(0, "base"), (1, "adapter")])
def test_adapter_greedy_equals_peft_through_the_handover_and_never_shares_base_pages(replicas, index, first):
    want = {"": expected()["base_greedy_token_ids"][index], ADAPTER: expected()["greedy_token_ids"][ADAPTER][index]}
    assert want[""] != want[ADAPTER]  # the adapter changes these tokens: base KV would show
    full_pages = len(expected()["prompts"][index]) // PAGE_SIZE
    order = ["", ADAPTER] if first == "base" else [ADAPTER, ""]
    for lora in order:  # each prompt new to the decode replica's cache under this chain: nothing reused
        assert handed_over(replicas, index, lora) == (want[lora], 0)
    for lora in order:  # again: each finds its own pages
        assert handed_over(replicas, index, lora) == (want[lora], full_pages)
    decode, prefill = status(replicas["decode"].address), status(replicas["prefill"].address)
    assert decode.num_reservations == 0 and decode.num_free_pages == decode.num_pages
    assert prefill.num_parked == 0 and decode.num_compiles_after_warmup == 0
