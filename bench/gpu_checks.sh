#!/usr/bin/env bash
# The GPU checks (issue #16 item 5), as one script for a lent GPU machine (the device tool):
#   1. the kernel-vs-reference tests and the start-up probe on the GPU backend (real lowering),
#   2. bench/kernels.py over the full grid: the Pallas decode kernel as a fraction of measured copy
#      bandwidth (target >= 0.7 at contexts >= 1k),
#   3. end-to-end decode of a ~32M Llama with attention_impl=pallas vs reference (and what auto picks),
#   4. a ~0.5B bf16 Llama (Qwen2.5-0.5B's shape, random weights: nothing can be downloaded there):
#      throughput against transformers' generate_batch (continuous batching, CUDA graphs) in the same
#      run (goal >= 3x), with the warm-up compile time (no compilation cache: startup_seconds),
#   5. the same model's single-stream decode against model.generate (goal >= 2x) and as a fraction of
#      the GPU's read bandwidth (the roofline).
# Writes everything under $OUT (default bench/results); summary.txt holds the lines that matter. JAX with
# CUDA, torch and transformers are in the device image; gguf is not, and its flax may lack what this
# project uses (nnx.capture), so carry both as wheels. Here, before the device call:
#   bash bench/gpu_wheels.sh "flax==$(.venv/bin/python -c 'import flax; print(flax.__version__)')" \
#     "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
# then, from the device tool (this script installs whatever .whl/ holds first):
#   run(command="bash bench/gpu_checks.sh", carry=[".whl"], timeout_s=600)
# and commit $OUT's files under bench/results/<gpu name>/. QUICK=1 shrinks every step, to try the script
# on a CPU (PYTHON=.venv/bin/python QUICK=1 OUT=/tmp/gpu_quick bash bench/gpu_checks.sh); the step
# timeouts add up to under the device tool's 600 s per call.
set -uo pipefail
OUT=${OUT:-bench/results}
export QUICK=${QUICK:-0}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PYTHON -m pip list 2>/dev/null | grep -E "^(jax|jaxlib|flax|numpy) " > "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/device.txt" 2>&1
$PYTHON -c "import jax; print(jax.devices())" >> "$OUT/device.txt" 2>&1
# the Pallas kernels' tests and the start-up probe; the C++ CPU kernels' and the reference's alone run on CPUs
timeout 80 $PYTHON -m pytest -p no:cacheprovider tests/kernels/test_kernels_vs_reference.py \
  tests/kernels/test_kernel_lowering.py tests/kernels/test_pages_in_place.py \
  -k "not cpu and not (dense and not pallas) and not bfloat16_attention and not pool_check" 2>&1 \
  | tee "$OUT/gpu_kernel_tests.txt"
timeout 50 $PYTHON -m pytest -p no:cacheprovider tests/kernels/test_attention_choice.py \
  tests/engine/test_attention_plan.py -k "pallas or probe or heuristic or gpu" 2>&1 | tee -a "$OUT/gpu_kernel_tests.txt"
timeout 100 $PYTHON bench/kernels.py --impls reference,pallas $([ "$QUICK" = 1 ] || echo --full) 2>&1 | tee "$OUT/kernels_gpu.jsonl"
timeout 80 $PYTHON - <<'PY' 2>&1 | tee "$OUT/decode_e2e_gpu.jsonl"
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
num_prompts, new_tokens = (4, 16) if quick else (32, 256)
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
# 4 and 5: the ~0.5B bf16 model, written once and shared by both runs
DEVICE=$($PYTHON -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
if [ "$QUICK" = 1 ]; then MODEL=llama-8m REQUESTS=4 OUTPUT=8 TOKENS=16; else MODEL=qwen2.5-0.5b REQUESTS=256 OUTPUT=128 TOKENS=128; fi
CKPT=$(mktemp -d)
timeout 170 $PYTHON bench/throughput.py --model $MODEL --dtype bfloat16 --device "$DEVICE" --checkpoint-dir "$CKPT" \
  --num-requests $REQUESTS --output-len $OUTPUT --max-num-seqs 64 --cold-compile 2>&1 | tee "$OUT/e2e_throughput.jsonl"
timeout 100 $PYTHON bench/throughput.py --single --model $MODEL --dtype bfloat16 --device "$DEVICE" \
  --checkpoint-dir "$CKPT" --single-tokens $TOKENS --repeats 2 2>&1 | tee "$OUT/e2e_single.jsonl"
rm -rf "$CKPT"
{ cat "$OUT/device.txt"; grep -h -E "passed|failed|error" "$OUT/gpu_kernel_tests.txt"
  grep -h -E '"(result|impl|engine)"' "$OUT"/kernels_gpu.jsonl "$OUT"/decode_e2e_gpu.jsonl "$OUT"/e2e_*.jsonl; } \
  > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
