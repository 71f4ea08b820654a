"""Which half of a handover an engine plays, by its config's role. The builder has compiled either
half's page copies before serving (ModelRunner.warm_up_handover_copies), so a handover never compiles."""

from __future__ import annotations

from jaxserve.config import EngineRole
from jaxserve.disagg.decode_side import DecodeHandovers
from jaxserve.disagg.prefill_side import PrefillHandovers


def handovers_for(engine):
    role = engine.config.disagg.role
    if role not in (EngineRole.PREFILL, EngineRole.DECODE):
        return None
    timeout = engine.config.disagg.handover_timeout
    if role == EngineRole.PREFILL:
        return PrefillHandovers(engine, timeout)
    # the decode side's reservation outlives its wait for the prefill side, so it is never freed under a pull
    return DecodeHandovers(engine, 2 * timeout + 10, engine.config.disagg.when_decode_full)
