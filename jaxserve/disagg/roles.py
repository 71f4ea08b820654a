"""Which half of a handover an engine plays, by its config's role; either half compiles its page copies
(every power-of-two chunk up to a sequence's pages) before serving, so a handover never compiles."""

from __future__ import annotations

from jaxserve.config import EngineRole
from jaxserve.device import page_copies
from jaxserve.disagg.decode_side import DecodeHandovers
from jaxserve.disagg.prefill_side import PrefillHandovers
from jaxserve.host.page_allocator import num_pages_for


def handovers_for(engine):
    role = engine.config.disagg.role
    if role not in (EngineRole.PREFILL, EngineRole.DECODE):
        return None
    warm_up_handover_copies(engine)
    timeout = engine.config.disagg.handover_timeout
    # the decode side's reservation outlives its wait for the prefill side, so it is never freed under a pull
    return (
        PrefillHandovers(engine, timeout) if role == EngineRole.PREFILL else DecodeHandovers(engine, 2 * timeout + 10)
    )


def warm_up_handover_copies(engine) -> None:
    runner = engine.runner
    max_pages = num_pages_for(engine.max_model_len, engine.config.cache.page_size)
    runner.kv_pages = page_copies.warm_up_handover_copies(runner.kv_pages, max_pages, runner.page_array_sharding())
