"""Which half of a handover an engine plays, by its config's role."""

from __future__ import annotations

from jaxserve.disagg.decode_side import DecodeHandovers
from jaxserve.disagg.prefill_side import PrefillHandovers


def handovers_for(engine):
    role = engine.config.role
    if role == "prefill":
        return PrefillHandovers(engine)
    if role == "decode":
        return DecodeHandovers(engine)
    return None
