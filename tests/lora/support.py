"""The LoRA fixtures (tests/lora/fixtures, written by tests/support/make_lora_fixtures.py with PEFT) and
helpers that write small adapters by hand for the bad-input tests."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from tests.support.fixtures import SMALL_ENGINE, fixture_dir

LORA_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
BASE_MODEL = fixture_dir("llama_gqa")


def expected() -> dict:
    with open(os.path.join(LORA_FIXTURES, "expected.json")) as f:
        return json.load(f)


def adapter_dir(name: str) -> str:
    return os.path.join(LORA_FIXTURES, name)


ADAPTER_NAMES = tuple(expected()["greedy_token_ids"])
# One decode and one prefill bucket (few executables); 8 adapter slots: every branch size of the batched
# LoRA matmul up to 8 adapters (pallas_kernels/matmul/lora.py) can occur.
LORA_ENGINE = dict(
    SMALL_ENGINE,
    decode_seq_buckets=(8,),
    prefill_token_buckets=(64,),
    lora=dict(adapters={name: adapter_dir(name) for name in ADAPTER_NAMES}, max_adapters=8, max_rank=8),
)


def write_adapter(directory: str, tensors: dict[str, np.ndarray], **config) -> str:
    """A PEFT-shaped adapter directory holding exactly these tensors."""
    os.makedirs(directory, exist_ok=True)
    settings = {**dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"], bias="none"), **config}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(settings, f)
    save_file(
        {name: np.ascontiguousarray(t, np.float32) for name, t in tensors.items()},
        os.path.join(directory, "adapter_model.safetensors"),
    )
    return directory


def lora_pair(module: str, size_in: int, size_out: int, rank: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random lora_A [rank, in] and lora_B [out, rank] for `module` ("layers.0.self_attn.q_proj")."""
    rng = np.random.default_rng(seed)
    prefix = f"base_model.model.model.{module}"
    return {
        f"{prefix}.lora_A.weight": rng.normal(size=(rank, size_in)).astype(np.float32),
        f"{prefix}.lora_B.weight": rng.normal(size=(size_out, rank)).astype(np.float32),
    }
