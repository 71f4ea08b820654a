#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (the device tool), each step under its own timeout so
# that the whole fits one call (under 520 s of steps; the lease is ~15 min with the machine's start):
#   1. the Pallas kernels' tests on the GPU backend (real Triton compiles): attention vs reference, on
#      int8 / float8_e4m3 pages too (issue 25), the quantized decode matmul (quantized_gpu.py), the probe,
#   2. bench/quantized_gpu_matmul.py: bf16, int8 and Q4_0 weights at a Llama-3-8B layer's shapes by XLA's dots
#      and by the Pallas kernel, as a fraction of the measured read bandwidth (issue 25: bytes per token),
#   3. bench/decode_step.py on a 4-layer Llama-3-8B-wide model (random weights: nothing can be downloaded
#      there) in bf16, int8 and int4: the decode step against the roofline of its bytes, end to end,
#   4. bench/kernels.py: the Pallas decode attention kernel as a fraction of copy bandwidth,
#   5. FULL=1 only (another call's worth): end-to-end decode of a ~32M Llama with attention_impl=pallas vs
#      reference (and what auto picks), and a ~0.5B bf16 Llama (Qwen2.5-0.5B's shape) against transformers'
#      generate_batch and model.generate, with the warm-up compile time (issue #16).
# Session 23 ran steps 1-4 on an H200 (bench/results/gpu-h200/): 367 s, the first pytest cut by its timeout
# after 32 passing tests (each case compiles its own Triton kernels: ~2 s a test there).
# Writes everything under $OUT (default bench/results; at most 8 files, what the device tool brings back), with a
# perfetto trace of five bfloat16 decode steps (the host's calls and the GPU's kernels on one timeline: open it in
# ui.perfetto.dev, or read it with bench/step_trace.py's helpers); summary.txt holds the lines that matter. JAX with
# CUDA, torch and transformers are in the device image; gguf and llguidance are not, and its flax may lack
# what this project uses (nnx.capture), so carry them as wheels. Here, before the device call:
#   bash bench/gpu_wheels.sh "flax==$(.venv/bin/python -c 'import flax; print(flax.__version__)')" \
#     "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
#     "llguidance==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llguidance"))')"
# then, from the device tool (this script installs what .whl/ holds first; flax only where the image's lacks
# nnx.capture):
#   run(command="bash bench/gpu_checks.sh", carry=[".whl"], timeout_s=560)
# and commit $OUT's files under bench/results/<gpu name>/. QUICK=1 shrinks every step, to try the script
# on a CPU (PYTHON=.venv/bin/python QUICK=1 OUT=/tmp/gpu_quick bash bench/gpu_checks.sh).
set -uo pipefail
OUT=${OUT:-bench/results}
export QUICK=${QUICK:-0}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  WHEELS=$(ls .whl/*.whl | grep -v /flax-)
  $PYTHON -c "from flax import nnx; nnx.capture" 2>/dev/null || WHEELS=".whl/*.whl"
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/device.txt" 2>&1
$PYTHON -c "import jax, flax, numpy; print(jax.devices(), 'jax', jax.__version__, 'flax', flax.__version__, 'numpy', numpy.__version__)" \
  >> "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
# the Pallas kernels' tests and the start-up probe, in one process (addopts' pytest-xdist workers need a wheel the
# GPU image does not have); the C++ CPU kernels' and the reference's alone run on CPUs
# (in the order of what has not run on a GPU yet: session 23's two calls ran 59 cases, all of the quantized
# matmul's and some of test_kernels_vs_reference's, before their timeouts; ~2 s a case, each compiles its kernels)
timeout 110 $PYTHON -m pytest -p no:cacheprovider -o addopts=-q -x tests/kernels/test_kv_quantization.py \
  tests/kernels/test_kernels_vs_reference.py tests/kernels/test_pages_in_place.py tests/kernels/test_quantized_gpu_matmul.py \
  -k "(quantized_gpu or pallas_gpu or pallas or splits or padded or write or pages_in_place) and not cpu and not tpu \
      and not lowers and not lower and not (dense and not pallas) and not bfloat16_attention and not pool_check" 2>&1 \
  | tee "$OUT/gpu_kernel_tests.txt"
timeout 40 $PYTHON -m pytest -p no:cacheprovider -o addopts=-q tests/kernels/test_attention_choice.py \
  tests/engine/test_attention_plan.py -k "pallas or probe or heuristic or gpu" 2>&1 | tee -a "$OUT/gpu_kernel_tests.txt"
# 2: quantized projections alone
timeout 70 $PYTHON bench/quantized_gpu_matmul.py --rows 1,32 $([ "$QUICK" = 1 ] && echo --quick) 2>&1 \
  | tee "$OUT/quantized_matmul_gpu.jsonl"
# 3: the decode step in bf16, int8, int4 on a 4-layer model 4096 wide (1.0B parameters, tied head)
MODEL_DIR=$(mktemp -d)
timeout 40 $PYTHON - "$MODEL_DIR" <<'PY'
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
from jaxserve.loading.default_model import random_llama_weights
quick = os.environ.get("QUICK") == "1"
width, inter, layers, heads, kv = (256, 768, 2, 4, 2) if quick else (4096, 14336, 4, 32, 8)
config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=width,
              intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=500000.0, torch_dtype="bfloat16")
block = (np.random.default_rng(0).standard_normal(1 << 24) * 0.02).astype(np.float16)  # tiled: speed only
weights = {name: np.resize(block, w.shape) if w.ndim == 2 else w.astype(np.float16)
           for name, w in random_llama_weights(dict(config, num_hidden_layers=0)).items()}
for layer in range(layers):
    prefix = f"model.layers.{layer}."
    q, k = heads * (width // heads), kv * (width // heads)
    for name, shape in dict(q_proj=(q, width), k_proj=(k, width), v_proj=(k, width), o_proj=(width, q)).items():
        weights[prefix + "self_attn." + name + ".weight"] = np.resize(block, shape)
    for name, shape in dict(gate_proj=(inter, width), up_proj=(inter, width), down_proj=(width, inter)).items():
        weights[prefix + "mlp." + name + ".weight"] = np.resize(block, shape)
    for name in ("input_layernorm", "post_attention_layernorm"):
        weights[prefix + name + ".weight"] = np.ones(width, np.float16)
json.dump(config, open(os.path.join(sys.argv[1], "config.json"), "w"))
save_file(weights, os.path.join(sys.argv[1], "model.safetensors"))
print("model written", sum(w.size for w in weights.values()) / 1e9, "B parameters")
PY
for QUANT in none int8 int4; do
  timeout 70 $PYTHON bench/decode_step.py --model "$MODEL_DIR" --dtypes bfloat16 --quantization $QUANT --rounds 1 \
    --batches 1,8,32 --repeats $([ "$QUICK" = 1 ] && echo 3 || echo 30) --new-tokens 32 --prompt-tokens 32 \
    $([ $QUANT = none ] && echo --save-trace "$OUT/decode_trace_bf16.json.gz") 2>&1 \
    | grep -v "^WARNING\|^I0000\|^W0000" | sed "s/^{/{\"quantization\": \"$QUANT\", /" | tee -a "$OUT/decode_quantized_gpu.jsonl"
done
rm -rf "$MODEL_DIR"
# 4: the attention kernel's bandwidth
timeout 40 $PYTHON bench/kernels.py --impls reference,pallas 2>&1 | tee "$OUT/kernels_gpu.jsonl"
# 5 (FULL=1): attention implementations end to end
if [ "${FULL:-0}" = 1 ]; then
timeout 60 $PYTHON - <<'PY' 2>&1 | tee -a "$OUT/full.jsonl"
import json, os, tempfile, time
from safetensors.numpy import save_file
from jaxserve import LLM, SamplingParams
from jaxserve.loading.default_model import random_llama_weights
config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=512,
              intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
              tie_word_embeddings=True, max_position_embeddings=4096, torch_dtype="bfloat16")
directory = tempfile.mkdtemp()
json.dump(config, open(os.path.join(directory, "config.json"), "w"))
save_file(random_llama_weights(config), os.path.join(directory, "model.safetensors"))
quick = os.environ.get("QUICK") == "1"
num_prompts, new_tokens = (4, 16) if quick else (32, 128)
prompts = [[1] + list(range(3, 3 + (100 if quick else 1000)))] * num_prompts
params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
first = None
for impl in ("reference", "pallas", "auto"):
    llm = LLM(directory, dtype="bfloat16", attention_impl=impl, max_model_len=256 if quick else 2048,
              max_num_seqs=num_prompts, max_num_batched_tokens=256 if quick else 2048, show_progress=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    first = first or tokens
    print(json.dumps(dict(impl=impl, resolved=llm.stats()["attention_impl"],
                          output_tokens_per_s=round(num_prompts * new_tokens / seconds, 1), seconds=round(seconds, 3),
                          same_tokens_as_reference=tokens == first,
                          compiles_after_warmup=llm.stats()["num_compiles_after_warmup"])))
PY
# 6 (FULL=1): the ~0.5B bf16 model against transformers, written once and shared by both runs
DEVICE=$($PYTHON -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
if [ "$QUICK" = 1 ]; then MODEL=llama-8m REQUESTS=4 OUTPUT=8 TOKENS=16; else MODEL=qwen2.5-0.5b REQUESTS=256 OUTPUT=128 TOKENS=128; fi
CKPT=$(mktemp -d)
timeout 170 $PYTHON bench/throughput.py --model $MODEL --dtype bfloat16 --device "$DEVICE" --checkpoint-dir "$CKPT" \
  --num-requests $REQUESTS --output-len $OUTPUT --max-num-seqs 64 --cold-compile 2>&1 | tee -a "$OUT/full.jsonl"
timeout 100 $PYTHON bench/throughput.py --single --model $MODEL --dtype bfloat16 --device "$DEVICE" \
  --checkpoint-dir "$CKPT" --single-tokens $TOKENS --repeats 2 2>&1 | tee -a "$OUT/full.jsonl"
rm -rf "$CKPT"
fi
{ cat "$OUT/device.txt"; grep -h -E "passed|failed|error" "$OUT/gpu_kernel_tests.txt"
  grep -h -E '"(check|error)"' "$OUT"/quantized_matmul_gpu.jsonl
  grep -h -E '"rows": (1|32), "variant": "(bf16_xla|int8_xla|int8_pallas|q4_0_xla|q4_0_pallas)"' "$OUT"/quantized_matmul_gpu.jsonl \
    | sed -E 's/"weight_mb"[^,]*, //; s/, "copies"[^}]*//'
  grep -h -E '"device_roofline_fraction"|Error' "$OUT"/decode_quantized_gpu.jsonl | cut -c1-400
  grep -h -E '"(result|impl|engine)"' "$OUT"/kernels_gpu.jsonl "$OUT"/full.jsonl 2>/dev/null; } \
  > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
