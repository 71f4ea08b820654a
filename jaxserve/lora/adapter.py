"""Reading a PEFT LoRA adapter: adapter_config.json + adapter_model.safetensors -> per-projection A and B.

PEFT stores, for each adapted nn.Linear, lora_A.weight [r, in] and lora_B.weight [out, r] under the module's
name in the PeftModel (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`). The forward it
computes is base(x) + lora_B(lora_A(x)) * scaling, with scaling = lora_alpha / r, or lora_alpha / sqrt(r)
with use_rslora (r and alpha per module where rank_pattern / alpha_pattern name it). Here A becomes [in, r]
and B [r, out] with the scaling folded in, keyed by our module path ("layers.3.self_attn.q_proj"), which is
the checkpoint's module name without its "model." prefix.

Routed experts of mixture-of-experts models are read by expert_adapter.py (per-expert Linears of older
checkpoints, or transformers 5's fused 3-D params adapted through PEFT's target_parameters) into per-expert
projections `layers.3.mlp.experts.5.gate_proj`.

Only what the engine computes exactly is accepted: plain LoRA (no DoRA, no LoRA bias, no extra trained
modules such as embeddings or the head) on decoder-layer projections. Anything else is a ValueError that
names it, so a request never silently runs an adapter that is not the one trained.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load_file

from jaxserve.lora.expert_adapter import FUSED_EXPERTS, fused_expert_projections, per_expert_path, scaling_for

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's tensor name: base_model.model. + the module's name in the model (model.layers...) + .lora_A/B.weight
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?((?:model\.)?)(layers\.\d+\..+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class Projection:
    a: np.ndarray  # [in, r] float32
    b: np.ndarray  # [r, out] float32, scaled by alpha / r (alpha / sqrt(r) with rsLoRA)

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    projections: dict[str, Projection]  # our module path ("layers.0.self_attn.q_proj") -> its A and B
    identity: int  # a signed 64-bit digest of the adapter's files: seeds its prefix-cache keys

    @property
    def max_rank(self) -> int:
        return max(projection.rank for projection in self.projections.values())


def read_adapter(path: str) -> LoraAdapter:
    """The adapter in a PEFT directory, checked for what the engine serves (ValueError naming what not)."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise ValueError(f"{path!r} is not a PEFT LoRA adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(config_path, "rb") as f:
        config_bytes = f.read()
    try:
        config = json.loads(config_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path}: not JSON ({error})") from None
    _check_config(config, path)
    try:
        tensors = load_file(weights_path)
    except Exception as error:  # safetensors raises its own SafetensorError (and OSError) for a bad or cut file
        raise ValueError(f"adapter {path!r}: cannot read {WEIGHTS_FILE} ({error})") from None
    halves: dict[str, dict[str, np.ndarray]] = {}
    prefix = ""  # the model's own prefix of the layers' names ("model."), which PEFT's patterns are matched with
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ValueError(
                f"adapter {path!r}: unsupported tensor {name!r} (only LoRA A/B of decoder-layer projections)"
            )
        prefix, module, half = match.groups()
        halves.setdefault(module, {})[half] = np.asarray(tensor, np.float32)
    projections, fused_experts, scale = {}, {}, scaling_for(config, prefix, path)
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: {module} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r]; a fused experts wrapper: [X * r, in], [out, r * X]
        if FUSED_EXPERTS.match(module):
            fused_experts[module] = (a, b)
            continue
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter {path!r}: {module}'s lora_A {a.shape} and lora_B {b.shape} do not chain")
        scaling = np.float32(scale(module, a.shape[0]))
        projection = Projection(a=np.ascontiguousarray(a.T), b=np.ascontiguousarray(b.T) * scaling)
        projections[per_expert_path(module) or module] = projection
    for module, (a, b) in fused_expert_projections(fused_experts, config, path, scale, prefix).items():
        projections[module] = Projection(a=a, b=b)
    if not projections:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    with open(weights_path, "rb") as f:
        digest = hashlib.blake2b(config_bytes, digest_size=8)
        digest.update(f.read())
    identity = int.from_bytes(digest.digest(), "little", signed=True)
    return LoraAdapter(path=path, projections=projections, identity=identity or 1)


# Checkpoints that fuse projections (Phi-3) are split at load (models/phi3.py); PEFT adapts the fused module,
# whose output columns are the parts' in this order, so each part takes the fused A and its own columns of B.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_fused(adapter: LoraAdapter, out_features: dict[str, int]) -> LoraAdapter:
    """The adapter with each fused projection (qkv_proj, gate_up_proj) split into the model's parts, where
    the model has them (out_features: our module path -> its output size)."""
    projections = {}
    for path, projection in adapter.projections.items():
        prefix, module = path.rsplit(".", 1)
        parts = [f"{prefix}.{part}" for part in FUSED_PROJECTIONS.get(module, ())]
        if not parts or any(part not in out_features for part in parts):
            projections[path] = projection
            continue
        sizes = [out_features[part] for part in parts]
        if sum(sizes) != projection.b.shape[1]:
            raise ValueError(
                f"adapter {adapter.path!r} maps {path} to {projection.b.shape[1]} features, where the model's "
                f"{'/'.join(FUSED_PROJECTIONS[module])} make {sum(sizes)} (an adapter for another base model?)"
            )
        for part, b in zip(parts, np.split(projection.b, np.cumsum(sizes)[:-1], axis=1)):
            projections[part] = Projection(a=projection.a, b=np.ascontiguousarray(b))
    return LoraAdapter(path=adapter.path, projections=projections, identity=adapter.identity)


def _check_config(config, path: str) -> None:
    if not isinstance(config, dict):
        raise ValueError(f"adapter {path!r}: {CONFIG_FILE} holds a JSON {type(config).__name__}, not an object")
    rank = config.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {path!r}: r must be a positive integer, got {rank!r}")
    if not _is_number(config.get("lora_alpha", 8)):
        raise ValueError(f"adapter {path!r}: lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    for name, valid in (("rank_pattern", lambda v: _is_number(v) and v >= 1), ("alpha_pattern", _is_number)):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and valid(v) for k, v in pattern.items()):
            raise ValueError(f"adapter {path!r}: {name} must map module names to numbers, got {pattern!r}")
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"adapter {path!r}: target_parameters must be a list of names, got {targets!r}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path!r} is a {config.get('peft_type')} adapter; only LoRA is served")
    refused = {
        "use_dora": "DoRA",
        "lora_bias": "LoRA biases",
        "modules_to_save": f"fully trained modules {config.get('modules_to_save')}",
        "trainable_token_indices": "trained token embeddings",
        "layer_replication": "layer replication",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) layers",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"adapter {path!r} uses {what}, which the engine does not serve")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r} trains biases (bias={config.get('bias')!r}); only bias='none' is served")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
