"""The sampler's kernels. The reference is jaxserve/device/sampler.py with sampling_draws.py (jax.numpy, any
backend); cpu.py is the C++ draw (cpu_sampler.cc) the CPU runs in its place."""
