"""What the HTTP handlers need of whatever runs their requests, so the same app serves a replica
(server/engine_loop.py: EngineLoop, over its engine) and the router (router/http_api.py: RoutedLoop,
forwarding to replicas)."""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from jaxserve.host.request import SamplingParams
from jaxserve.server.request_stream import RequestStream


class GenerationLoop(Protocol):
    description: Any  # model_name, max_model_len, max_num_seqs (engine/stats.py: EngineDescription)
    max_in_flight: int  # requests it holds at once (a completion with more prompts is refused)
    engine: Any  # its tokenizer (and, on a replica, its config: a prefill replica refuses generation)

    @property
    def draining(self) -> bool: ...

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str = "", session_id: str | None = None
    ) -> RequestStream:
        """Queue one prompt (ValueError for a bad one, Overloaded or Draining when it cannot)."""
        ...

    def release(self, stream: RequestStream) -> None:
        """The HTTP call is over: abort the request if it still runs."""
        ...


class RefusalMetrics(Protocol):
    """The app exports `registry` at /metrics and counts refusals in `rejected` (by gRPC status)."""

    registry: CollectorRegistry
    rejected: Counter
