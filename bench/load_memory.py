"""Peak host memory while loading weights, per checkpoint format: the goal is <= 1.3x the weights.

    .venv/bin/python bench/load_memory.py [--model default] [--dtypes float32,bfloat16]
                                          [--formats gguf,gguf-f32,safetensors,orbax]
                                          [--quantization none,int8,int4,auto] [--quantization-group-size 32]

The same weights in each format, written once to a temporary directory from the model (the default
model's GGUF file dequantized): `gguf` the model's own GGUF file (quantized for the default model),
`gguf-f32` an F32 GGUF file of it, `safetensors` a Hugging Face directory (float32 tensors), `orbax` a
jaxserve checkpoint saved in the served dtype. Each load runs in a fresh subprocess, which reports
peak resident memory (VmHWM) minus the peak after importing jax, flax and jaxserve and starting the
CPU backend (so imports and the runtime do not count), against the bytes of the loaded params. On a
CPU the params themselves live in host memory, so 1.0x is the floor. Only the weights are loaded (the
engine's start-up path, builder._load_model): no KV pages, no compilation.

--quantization loads each file with each model.quantization (issue 25): the goal is then <= 1.3x the
*quantized* weights plus one float tensor (quantizing at load holds the float tensor being quantized), so
each line also gives the largest param's float bytes and `within_limit` against that sum.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

LIMIT = 1.3


def peak_rss() -> int:
    """This process's peak resident memory: Linux's VmHWM, which starts afresh at exec. (getrusage's
    ru_maxrss would do elsewhere, but on Linux a child inherits its parent's peak through fork and exec.)"""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path: str, dtype: str, quantization: str = "none", group_size: int = 32) -> None:
    import jax
    import numpy as np
    from flax import nnx  # noqa: F401  (imported before the baseline: import cost is not load cost)

    from jaxserve.config import EngineConfig
    from jaxserve.engine.attention_plan import choose_attention
    from jaxserve.engine.builder import _load_model
    from jaxserve.loading.model_source import open_model
    from jaxserve.loading.quantize import QuantizationSpec

    jax.devices()
    baseline = peak_rss()
    source = open_model(path)
    attention = choose_attention(source.config, EngineConfig.from_options(attention_impl="reference"), dtype, None)
    model = _load_model(source, dtype, attention, None, False, QuantizationSpec(quantization, group_size))
    params = [variable.get_value() for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    leaves = jax.tree.leaves(params)
    jax.block_until_ready(leaves)
    peak = peak_rss()
    weights = sum(leaf.nbytes for leaf in leaves)
    # a quantized param's shape is its float one: what quantizing it at load held on the host
    largest_float = max(int(np.prod(value.shape)) * np.dtype(dtype).itemsize for value in params)
    print(
        json.dumps(
            dict(weights_bytes=weights, load_peak_rss_bytes=peak - baseline, largest_float_tensor_bytes=largest_float)
        )
    )


def measure(path: str, dtype: str, quantization: str = "none", group_size: int = 32) -> dict:
    command = [sys.executable, __file__, "--child", path, "--dtypes", dtype, "--quantization", quantization]
    command += ["--quantization-group-size", str(group_size)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"loading {path} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_formats(model_path: str, directory: str, formats: list[str], dtypes: list[str]) -> dict[str, dict]:
    """{format: {dtype: path}}: the model's weights in each format, as float32 values."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.loading.gguf import GGUFFile, find_gguf_file

    gguf_path = find_gguf_file(model_path)
    paths: dict[str, dict] = {}
    if gguf_path is None:
        raise SystemExit("load_memory.py starts from a GGUF file (e.g. --model default)")
    gguf = GGUFFile(gguf_path)
    if "gguf" in formats:
        paths["gguf"] = dict.fromkeys(dtypes, gguf_path)
    config = gguf.hf_config()
    reader = gguf.tensor_reader()
    hf_dir = os.path.join(directory, "hf")
    if {"safetensors", "orbax"} & set(formats):
        os.makedirs(hf_dir)
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(dict(config, torch_dtype="float32"), f)
        save_file(
            {name: np.ascontiguousarray(reader.read(name)) for name in reader.names},
            os.path.join(hf_dir, "model.safetensors"),
        )
        paths["safetensors"] = dict.fromkeys(dtypes, hf_dir)
    if "gguf-f32" in formats:
        paths["gguf-f32"] = dict.fromkeys(dtypes, write_f32_gguf(gguf_path, directory))
    if "orbax" in formats:
        paths["orbax"] = {
            dtype: write_orbax(hf_dir, os.path.join(directory, f"orbax-{dtype}"), dtype) for dtype in dtypes
        }
    return {name: paths[name] for name in formats if name in paths}


def write_f32_gguf(gguf_path: str, directory: str) -> str:
    """The GGUF file dequantized to F32 by llama-quantize (built by bench/vs_llamacpp.py, which must have
    run once)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llamacpp_peer as peer

    cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    if not os.access(peer.binary(cache_dir, "llama-quantize"), os.X_OK):
        raise SystemExit("gguf-f32 needs llama-quantize: run bench/vs_llamacpp.py once, or drop gguf-f32")
    target = os.path.join(directory, "model-f32.gguf")
    peer.quantize(cache_dir, gguf_path, target, "F32", allow_requantize=True)
    return target


def write_orbax(hf_dir: str, directory: str, dtype: str) -> str:
    script = (
        f"from jaxserve import LLM; LLM({hf_dir!r}, dtype={dtype!r}, num_pages=4, max_model_len=64, max_num_seqs=1, "
        f"max_num_batched_tokens=64, show_progress=False).save_checkpoint({directory!r})"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=1800)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--formats", default="gguf,gguf-f32,safetensors,orbax")
    parser.add_argument("--quantization", default="none", help="model.quantization values, comma-separated")
    parser.add_argument("--quantization-group-size", type=int, default=32)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.dtypes, args.quantization, args.quantization_group_size)
    from jaxserve.loading.default_model import resolve_model_path

    dtypes = args.dtypes.split(",")
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="jaxserve-load-memory-") as directory:
        for fmt, by_dtype in write_formats(
            resolve_model_path(args.model), directory, args.formats.split(","), dtypes
        ).items():
            for dtype, path in by_dtype.items():
                for quantization in args.quantization.split(","):
                    if fmt == "orbax" and quantization != "none":
                        continue  # an orbax checkpoint restores as saved, whatever the option says
                    record = measure(path, dtype, quantization, args.quantization_group_size)
                    ratio = record["load_peak_rss_bytes"] / record["weights_bytes"]
                    worst = max(worst, ratio)
                    extra = 0 if quantization == "none" else record["largest_float_tensor_bytes"]
                    print(
                        json.dumps(
                            dict(
                                format=fmt,
                                dtype=dtype,
                                quantization=quantization,
                                weights_mb=round(record["weights_bytes"] / 2**20, 1),
                                load_peak_rss_mb=round(record["load_peak_rss_bytes"] / 2**20, 1),
                                largest_float_tensor_mb=round(record["largest_float_tensor_bytes"] / 2**20, 1),
                                ratio=round(ratio, 2),
                                within_limit=record["load_peak_rss_bytes"] <= LIMIT * record["weights_bytes"] + extra,
                            )
                        ),
                        flush=True,
                    )
    print(json.dumps(dict(result="load_memory", worst_ratio=round(worst, 2), limit=LIMIT)))


if __name__ == "__main__":
    main()
