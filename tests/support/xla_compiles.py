"""Every XLA backend compile while a block runs, as JAX itself reports them (jax.monitoring), not only the
executables the engine compiles and counts (num_compiles_after_warmup)."""

import contextlib

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def xla_compiles():
    """Yields a list that holds each compile's duration in seconds once the block has run."""
    compiles: list[float] = []

    def listen(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
