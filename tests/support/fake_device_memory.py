"""A device that reports its free memory, as a GPU or TPU does, on the CPU: `limit` bytes, of which what jax
holds live (each buffer once) since the fake was made is in use. Patches runner.measured_free_bytes where the
engine reads it (the KV budget, the draft's share, the scratch check)."""

import contextlib

import jax
import pytest

import jaxserve.device.runner as runner_module
import jaxserve.engine.builder as builder_module


def live_bytes() -> int:
    # an array's shards (addressable_shards, read by stats) are arrays over the same buffer: count buffers
    return sum({array.unsafe_buffer_pointer(): array.nbytes for array in jax.live_arrays()}.values())


@contextlib.contextmanager
def device_of(limit: int):
    with pytest.MonkeyPatch.context() as patch:
        baseline = live_bytes()  # what other modules' engines hold: not on the fake device
        free = lambda mesh=None: limit - (live_bytes() - baseline)  # noqa: E731
        patch.setattr(runner_module, "measured_free_bytes", free)
        patch.setattr(builder_module, "measured_free_bytes", free)
        yield free
