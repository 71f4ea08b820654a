"""The engine: start-up (builder), the loop (Engine.step: schedule -> run -> postprocess)."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["Engine"]

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine


def __getattr__(name: str):
    # Imported on first use: jaxserve.engine.fingerprint is plain Python, and the router (which must not
    # load JAX) imports it through this package.
    if name != "Engine":
        raise AttributeError(f"module 'jaxserve.engine' has no attribute {name!r}")
    from jaxserve.engine.engine import Engine

    return Engine
