"""A prefill replica and a decode replica with different meshes, in two `jaxserve.serve` processes on
loopback (2 fake CPU devices each): the prefill side splits its KV heads over 2 devices, the decode side
holds them on one. Greedy outputs through Decode.Generate equal transformers'; the pages crossed the
transfer server; nothing compiled after warm-up; no page is held afterwards on either side."""

import time

import grpc
import pytest

from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc, jaxserve_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.launcher import LaunchedReplica, is_serving
from tests.support.fixtures import expected, fixture_dir

ENGINE = (
    "model.dtype=float32",
    "engine.max_model_len=128",
    "engine.max_num_seqs=4",
    "engine.decode_seq_buckets=[4]",  # one decode bucket: one executable less to compile on each replica
    "engine.max_num_batched_tokens=64",
    "engine.page_size=8",
    "engine.num_pages=48",
    "engine.show_progress=false",
    "engine.handover_timeout=15",
    "server.http_port=0",
)
STARTUP_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # for the replicas
    log_dir = str(tmp_path_factory.mktemp("replicas"))
    launched = [
        LaunchedReplica(
            index,
            fixture_dir("llama_gqa"),
            None,
            ENGINE + (f"engine.role={role}", f"engine.tensor_parallel_size={tp}"),
            log_dir,
        )
        for index, (role, tp) in enumerate((("prefill", 2), ("decode", 1)))
    ]
    try:
        for replica in launched:
            replica.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for replica in launched:
            while not is_serving(replica.address):
                assert replica.process.poll() is None and time.monotonic() < deadline, replica.log_tail()
                time.sleep(0.2)
        yield launched
    finally:
        for replica in launched:
            replica.stop(timeout=10)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def call(address: str, stub_class, method: str, request):
    with grpc.insecure_channel(address) as channel:
        return getattr(stub_class(channel), method)(request, timeout=60)


def test_greedy_outputs_equal_across_meshes_and_processes(replicas):
    prefill, decode = replicas
    meshes = [
        call(r.address, jaxserve_pb2_grpc.GenerationStub, "GetServerInfo", pb.ServerInfoRequest()).mesh
        for r in replicas
    ]
    assert meshes[0] != meshes[1], meshes
    with grpc.insecure_channel(decode.address) as channel:
        stub = disagg_pb2_grpc.DecodeStub(channel)
        for job in expected("llama_gqa")["prompts"]:
            request = dpb.DecodeRequest(
                prefill_address=prefill.address,
                request=pb.GenerateRequest(
                    token_ids=job["token_ids"], sampling=pb.SamplingParams(max_tokens=24, temperature=0.0)
                ),
            )
            assert [t for m in stub.Generate(request, timeout=120) for t in m.token_ids] == job["greedy_token_ids"]
    sides = [call(r.address, disagg_pb2_grpc.PrefillStub, "Status", dpb.StatusRequest()) for r in replicas]
    assert sides[1].num_handovers > 0 and sides[1].bytes_moved == sides[0].bytes_moved > 0
    assert sides[1].num_recomputed == 0 and [s.num_compiles_after_warmup for s in sides] == [0, 0]
    assert all(s.num_free_pages == s.num_pages and s.num_parked == s.num_reservations == 0 for s in sides)
