"""What the HTTP handlers share: the engine loop once warm, the limits, the model's name, and a
small pool for the blocking part of admitting a large request (checks, the chat template, tokenizing)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from jaxserve.config import EngineRole
from jaxserve.host.request import SamplingParams
from jaxserve.server.limits import RequestLimits
from jaxserve.server.openai.errors import APIError, api_error
from jaxserve.server.openai.loop import GenerationLoop, RefusalMetrics
from jaxserve.server.openai.response_store import ResponseStore
from jaxserve.server.openai.streams import StreamGroup, submit_all
from jaxserve.server.reasoning_parsers import ReasoningParser, reasoning_parser
from jaxserve.server.tool_choice import parser_for_template
from jaxserve.server.tool_parsers import ToolParser

ADMISSION_THREADS = 4  # tokenizing is short; more threads would only contend for the GIL
# Requests up to this size are checked, tokenized and submitted on the event loop: handing them to a
# thread and back costs two waits for the GIL behind the engine thread (measured: about one engine
# step more TTFT than gRPC), more than the work itself.
INLINE_ADMISSION_BYTES = 16384
Extra = TypeVar("Extra")  # what a handler's checks hand on to its response besides prompts and params
# HTTP refusals are counted beside gRPC's, under the gRPC status each one stands for.
REFUSAL_LABELS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
}


class ServingContext:
    def __init__(
        self,
        metrics: RefusalMetrics,
        served_model_names: tuple[str, ...] = (),
        response_store: ResponseStore | None = None,
    ):
        """served_model_names: server.served_model_name, the names clients know the model by (the first
        is the one responses carry); none: the checkpoint's own name. response_store: where /v1/responses
        keeps what it stores (server.responses_store_*); none: one with the default bounds."""
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.response_store = response_store if response_store is not None else ResponseStore()
        self.loop: GenerationLoop | None = None  # set once the engine has warmed up
        self._limits: RequestLimits | None = None
        self.chat_template: str | None = None
        self.tool_call_parser = "auto"  # server.tool_call_parser
        self.reasoning_parser = "auto"  # server.reasoning_parser
        self.system_fingerprint = ""
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(ADMISSION_THREADS, thread_name_prefix="jaxserve-http-admit")

    def attach(
        self,
        loop: GenerationLoop,
        limits: RequestLimits,
        chat_template: str | None,
        system_fingerprint: str,
        tool_call_parser: str = "auto",
    ) -> None:
        self._limits = limits
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.system_fingerprint = system_fingerprint
        self.loop = loop

    def ready_loop(self) -> GenerationLoop:
        if self.loop is None:
            raise APIError(503, "the engine is still warming up")
        if self.loop.draining:
            raise APIError(503, "the server is shutting down")
        return self.loop

    @property
    def limits(self) -> RequestLimits:
        if self._limits is None:
            raise APIError(503, "the engine is still warming up")
        return self._limits

    @property
    def checkpoint_name(self) -> str:
        return self.loop.description.model_name if self.loop is not None else ""

    @property
    def model_names(self) -> tuple[str, ...]:
        """What /v1/models lists, the primary name first."""
        return self.served_model_names or (self.checkpoint_name,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tokenizer(self):
        tokenizer = self.ready_loop().engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "the model has no tokenizer: send token ids")
        return tokenizer

    def reasoning(self) -> ReasoningParser | None:
        """server.reasoning_parser's parser for the served model; None: replies are all content (also for
        "auto" where the tokenizer cannot write the model's reasoning format)."""
        engine = self.ready_loop().engine
        try:
            # a router's loop stands in for an engine: its tokenizer and model config (None in a bare stand-in)
            model_config = getattr(engine, "model_config", None)
            model_type = model_config.model_type if model_config is not None else ""
            return reasoning_parser(self.reasoning_parser, model_type, engine.tokenizer)
        except ValueError:
            if self.reasoning_parser == "auto":
                return None
            raise

    def tool_parser(self, tools) -> ToolParser:
        """server.tool_call_parser's parser; "auto" reads the template this chat renders with."""
        return parser_for_template(self.tool_call_parser, self.tokenizer, self.chat_template, tools)

    def check_model(self, name: str | None) -> str | None:
        """404 for a model this server does not serve, as vLLM answers; no name (or an empty one) means
        the served model. The checkpoint's own name stays accepted beside served_model_name's aliases,
        so that clients written before the aliases keep working. A loaded LoRA adapter's name is a model
        too: returns that name (None for the base model)."""
        if name and name in self.lora_names():
            return name
        if name and name not in self.model_names and name != self.checkpoint_name:
            served = ", ".join(f"'{served}'" for served in self.model_names)
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served}", "model")
        return None

    def lora_adapters(self) -> list[dict]:
        """The engine's loaded LoRA adapters (name, slot, path, rank); none for an engine without slots."""
        adapters = getattr(self.loop.engine, "lora_adapters", None) if self.loop is not None else None
        return adapters() if adapters is not None else []

    def lora_names(self) -> tuple[str, ...]:
        return tuple(adapter["name"] for adapter in self.lora_adapters())

    def response_model(self, name: str | None) -> str:
        """The model a response names: the LoRA adapter the request asked for, else the served model."""
        return name if name and name in self.lora_names() else self.model_name

    def on_refusal(self, status: int) -> None:
        self.metrics.rejected.labels(REFUSAL_LABELS.get(status, str(status))).inc()

    async def run(self, function, *args, **kwargs):
        """function(*args, **kwargs) on the admission pool; its refusals become APIErrors."""
        call = functools.partial(function, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, call)
        except (ValueError, APIError) as error:
            raise api_error(error) from None

    async def admit(
        self,
        request_size: int | None,
        check: Callable[[], tuple[list, SamplingParams, Extra]],
        request_id: str,
        session_id: str | None,
    ) -> tuple[StreamGroup, Extra]:
        """check() -> (prompts, params, extra) runs the request's checks (ValueError), then every prompt is
        submitted; returns the streams and extra. A small request is admitted right here on the event
        loop; a larger one (or one of unknown size) on the admission pool, so that tokenizing it never
        stalls the other streams."""
        loop = self.ready_loop()
        # A prefill replica's requests would stop at their first token (gRPC refuses them too). The
        # router serves this app over a stand-in engine without a config: it never prefills only.
        config = getattr(loop.engine, "config", None)
        if config is not None and config.disagg.role == EngineRole.PREFILL:
            raise APIError(
                400,
                "this replica prefills for decode replicas (engine.role prefill): send requests "
                "to a router in mode disaggregated",
            )

        def admission():
            prompts, params, extra = check()
            return submit_all(loop, prompts, params, request_id, session_id), extra

        if request_size is not None and request_size <= INLINE_ADMISSION_BYTES:
            try:
                streams, extra = admission()
            except Exception as error:
                raise api_error(error) from None
            return StreamGroup(loop, streams), extra
        admitted = asyncio.get_running_loop().run_in_executor(self.executor, admission)
        try:
            streams, extra = await asyncio.shield(admitted)
        except asyncio.CancelledError:  # the client left while its request was being admitted
            admitted.add_done_callback(functools.partial(_release_when_admitted, loop))
            raise
        except Exception as error:
            raise api_error(error) from None
        return StreamGroup(loop, streams), extra

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _release_when_admitted(loop: GenerationLoop, admitted: asyncio.Future) -> None:
    if not admitted.cancelled() and admitted.exception() is None:
        for stream in admitted.result()[0]:
            loop.release(stream)


def request_size(request) -> int | None:
    """The body's declared size (the guard has held it to the limit); None when not declared."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


def with_adapter(
    checked: tuple[list, SamplingParams, Extra], adapter: str | None
) -> tuple[list, SamplingParams, Extra]:
    """A request's checked (prompts, params, extra) with params generating through `adapter` (the LoRA
    adapter its `model` field named; None: the base model)."""
    prompts, params, extra = checked
    return prompts, params if adapter is None else dataclasses.replace(params, lora=adapter), extra
