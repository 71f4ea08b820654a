#!/usr/bin/env bash
# Wheels for the GPU machine (the device tool), fetched here where PyPI is reachable, into .whl/
# (ignored by git, carried by the tool). Only for a package whose version on the device is too old;
# the device image already has jax with CUDA, flax, orbax, safetensors and sentencepiece.
#   bash bench/gpu_wheels.sh flax==0.12.8 gguf==0.19.0 llguidance==1.9.1 (llguidance: manylinux_2_31)
set -euo pipefail
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any -d .whl "$@"
