"""LoRA over the wire: adapters from the config file, addressed by the OpenAI `model` field and gRPC's
SamplingParams.lora, listed in /v1/models; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter and
gRPC's LoadLoRA / UnloadLoRA at run time; bad adapters and names refused (400 / INVALID_ARGUMENT) while
the server keeps serving, and nothing compiles after warm-up."""

from __future__ import annotations

import json

import grpc
import pytest
import yaml

from jaxserve.client import Client
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.server.config_file import load_config
from tests.lora.support import BASE_MODEL, adapter_dir, expected
from tests.support.openai_harness import error_of, http
from tests.support.server_harness import ServerProcess

PROMPTS = expected()["prompts"]
MAX_TOKENS = len(expected()["base_greedy_token_ids"][0])


def want(adapter: str | None, index: int) -> list[int]:
    if adapter is None:
        return expected()["base_greedy_token_ids"][index]
    return expected()["greedy_token_ids"][adapter][index]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = dict(
        max_num_seqs=8,
        decode_seq_buckets=[8],
        prefill_token_buckets=[64],
        adapters={"attn": adapter_dir("attn_r4")},
        max_adapters=2,
        max_rank=8,
    )
    process = ServerProcess(tmp_path_factory.mktemp("lora"), engine=engine)
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


def grpc_tokens(server, index: int, lora: str = "") -> list[int]:
    client = Client(server.target)
    try:
        return client.generate(PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0.0, lora=lora).token_ids
    finally:
        client.close()


def complete(server, model: str, index: int) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    status, _, raw = http(server, "POST", "/v1/completions", body)
    return status, json.loads(raw)


def test_config_adapter_over_grpc_and_http(server):
    assert grpc_tokens(server, 1, "attn") == want("attn_r4", 1)
    assert grpc_tokens(server, 1) == want(None, 1)
    status, reply = complete(server, "attn", 1)
    assert status == 200 and reply["model"] == "attn"
    assert reply["choices"][0]["text"] == Client(server.target).detokenize(want("attn_r4", 1))
    status, _, raw = http(server, "GET", "/v1/models")
    models = {entry["id"]: entry for entry in json.loads(raw)["data"]}
    assert models["attn"]["root"] == adapter_dir("attn_r4") and models["attn"]["parent"] == "llama_gqa"
    assert "llama_gqa" in models


def test_http_load_and_unload(server):
    status, _, raw = http(
        server, "POST", "/v1/load_lora_adapter", {"lora_name": "mixed", "lora_path": adapter_dir("mixed_r3")}
    )
    assert status == 200 and b"added successfully" in raw
    status, reply = complete(server, "mixed", 2)
    assert status == 200
    assert grpc_tokens(server, 2, "mixed") == want("mixed_r3", 2)
    # both slots taken now
    status, _, raw = http(
        server, "POST", "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": adapter_dir("mlp_r8_rslora")}
    )
    assert status == 400 and "slots are in use" in error_of(raw)["message"]
    status, _, raw = http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "mixed"})
    assert status == 200 and b"removed successfully" in raw
    status, reply = complete(server, "mixed", 2)
    assert status == 404 and "does not exist" in reply["error"]["message"]
    status, _, raw = http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "mixed"})
    assert status == 400 and "unknown LoRA adapter" in error_of(raw)["message"]


def test_bad_adapters_over_http_keep_the_server_serving(server, tmp_path):
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "nothing")}, "not a PEFT LoRA adapter directory"),
        ({"lora_name": "attn", "lora_path": adapter_dir("attn_r4")}, "already loaded"),
        ({"lora_name": "llama_gqa", "lora_path": adapter_dir("attn_r4")}, "base model's name"),
    ]
    for body, message in cases:
        status, _, raw = http(server, "POST", "/v1/load_lora_adapter", body)
        assert status == 400 and message in error_of(raw)["message"], raw
    status, reply = complete(server, "nope", 0)
    assert status == 404
    assert grpc_tokens(server, 0, "attn") == want("attn_r4", 0)


def test_grpc_load_unload_and_refusals(server):
    stub = jaxserve_pb2_grpc.GenerationStub(server.channel)
    reply = stub.LoadLoRA(pb.LoadLoRARequest(name="rslora", path=adapter_dir("mlp_r8_rslora")))
    assert reply.slot in (1, 2) and reply.rank == 8
    assert grpc_tokens(server, 3, "rslora") == want("mlp_r8_rslora", 3)
    with pytest.raises(grpc.RpcError) as refused:
        stub.LoadLoRA(pb.LoadLoRARequest(name="again", path=adapter_dir("mixed_r3")))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slots" in refused.value.details()
    stub.UnloadLoRA(pb.UnloadLoRARequest(name="rslora"))
    with pytest.raises(grpc.RpcError) as refused:
        grpc_tokens(server, 3, "rslora")
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown LoRA adapter" in refused.value.details()
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.UnloadLoRA(pb.UnloadLoRARequest(name="rslora"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_tokens(server, 4, "attn") == want("attn_r4", 4)
    assert server.metric("jaxserve_compiles_after_warmup") == 0


def test_config_file_lora_section(tmp_path):
    path = tmp_path / "config.yaml"
    config = {"model": {"path": BASE_MODEL}, "lora": {"adapters": {"a": adapter_dir("attn_r4")}, "max_rank": 8}}
    path.write_text(yaml.safe_dump(config))
    lora = load_config(str(path)).engine.lora
    assert lora.adapters == {"a": adapter_dir("attn_r4")} and lora.max_adapters == 1 and lora.max_rank == 8
