"""The embedded default model: a small Llama built offline, so jaxserve runs on a fresh machine.

Its weights are random (drawn from a fixed seed), so its text is noise: it exists to exercise the
whole engine without a download, not to say anything. The tokenizer is a real sentencepiece model
shipped in jaxserve/loading/assets. The checkpoint is written once, in Hugging Face layout, under the
user's cache directory.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
SEED = 20261130
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=256,
    intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)


def random_llama_weights(config: dict, seed: int = SEED) -> dict[str, np.ndarray]:
    """Random weights, in Hugging Face names, for a dense Llama config (benchmarks and the default)."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": matrix(config["vocab_size"], hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = matrix(config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights.update({
            prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "self_attn.q_proj.weight": matrix(hidden, hidden),
            prefix + "self_attn.k_proj.weight": matrix(kv, hidden),
            prefix + "self_attn.v_proj.weight": matrix(kv, hidden),
            prefix + "self_attn.o_proj.weight": matrix(hidden, hidden),
            prefix + "mlp.gate_proj.weight": matrix(inter, hidden),
            prefix + "mlp.up_proj.weight": matrix(inter, hidden),
            prefix + "mlp.down_proj.weight": matrix(hidden, inter),
        })
    return weights


def default_model_dir(cache_dir: str | None = None) -> str:
    """The directory of the default checkpoint, written there on first use."""
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    directory = os.path.join(cache_dir, f"default-llama-{SEED}")
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        staging = directory + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(CONFIG, f, indent=1)
        shutil.copy(os.path.join(ASSETS, "tokenizer.model"), staging)
        save_file(random_llama_weights(CONFIG), os.path.join(staging, "model.safetensors"))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(staging, directory)
    return directory
