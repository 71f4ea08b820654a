"""The engine: start-up (builder), the loop (Engine.step: schedule -> run -> postprocess)."""

from jaxserve.engine.engine import Engine

__all__ = ["Engine"]
