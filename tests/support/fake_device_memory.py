"""A device that reports its free memory, as a GPU or TPU does, on the CPU: `limit` bytes, of which what jax
holds live (each buffer once) since the fake was made is in use. Patches runner.measured_free_bytes where the
engine reads it (the KV budget, the draft's share, the scratch check)."""

import contextlib
import weakref

import jax
import pytest

import jaxserve.device.runner as runner_module
import jaxserve.engine.kv_budget as kv_budget


def live_bytes(before: dict | None = None) -> int:
    """The bytes of jax's live buffers (each once: an array's addressable_shards, read by stats, are arrays over
    the same buffer), leaving out the arrays alive in `before` (before_now): what other modules' engines hold
    is not on the fake device, and the garbage of earlier tests, freed while an engine is built, would otherwise
    count as memory the build freed."""
    before = before or {}
    return sum(
        {
            array.unsafe_buffer_pointer(): array.nbytes
            for array in jax.live_arrays()
            if not (id(array) in before and before[id(array)]() is array)
        }.values()
    )


def before_now() -> dict:
    return {id(array): weakref.ref(array) for array in jax.live_arrays()}


@contextlib.contextmanager
def device_of(limit: int):
    with pytest.MonkeyPatch.context() as patch:
        before = before_now()
        free = lambda mesh=None: limit - live_bytes(before)  # noqa: E731
        patch.setattr(runner_module, "measured_free_bytes", free)
        patch.setattr(kv_budget, "measured_free_bytes", free)
        yield free
