"""The jaxserve.v1.Generation gRPC service over an EngineLoop (methods take parsed requests; rpc.py
parses the bytes and places each method on its thread pool)."""

from __future__ import annotations

import contextlib

import grpc

import jaxserve
from jaxserve.config import EngineRole
from jaxserve.host.request import SamplingParams, truncate_prompt
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server import limits as request_limits
from jaxserve.server.engine_loop import Draining, EngineLoop, Overloaded
from jaxserve.server.grpc_chat import checked_chat, with_tool_calls
from jaxserve.server.kv_events_service import router_info
from jaxserve.server.limits import RequestLimits
from jaxserve.server.reasoning_parsers import (
    engine_reasoning_parser,
    reply_reasoning_start,
    with_grammar_after_reasoning,
)
from jaxserve.server.request_stream import Delta
from jaxserve.server.rpc import abort
from jaxserve.server.sampling_proto import (  # re-exported: the router reads them from here
    DEFAULT_MAX_TOKENS,
    check_sampling,
    sampling_params_from_proto,
    stop_reason_fields,
    token_logprobs_message,
)
from jaxserve.server.tool_choice import NO_TOOLS, ToolPlan

__all__ = ["DEFAULT_MAX_TOKENS", "GenerationService", "checked_request", "sampling_params_from_proto"]


def checked_request(limits: RequestLimits, request: pb.GenerateRequest) -> tuple[str | list[int], SamplingParams]:
    """The prompt and sampling params of a request within the server's limits; cheap checks first,
    all before tokenizing. Raises ValueError naming the limit."""
    request_limits.check_ids(limits, request_id=request.request_id, session_id=request.session_id)
    token_ids = request.token_ids
    if token_ids and request.sampling.HasField("truncate_prompt_tokens"):  # only the last ones count (as over HTTP)
        token_ids = truncate_prompt(list(token_ids), request.sampling.truncate_prompt_tokens, limits.max_prompt_tokens)
    prompt = request_limits.check_prompt(limits, request.text, token_ids)
    check_sampling(limits, request.sampling)
    return prompt, sampling_params_from_proto(request.sampling)


def response_from_delta(delta: Delta, request_id: str) -> pb.GenerateResponse:
    logprobs = [token_logprobs_message(t, top) for t, top in zip(delta.token_ids, delta.logprobs or [])]
    prompt_logprobs = [
        token_logprobs_message(t, top)
        for t, top in zip(delta.prompt_token_ids or (), delta.prompt_logprobs or ())
        if top is not None  # the first prompt token's
    ]
    return pb.GenerateResponse(
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=delta.finish_reason or "",
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        logprobs=logprobs,
        request_id=request_id,
        index=delta.index,
        prompt_logprobs=prompt_logprobs,
        **stop_reason_fields(delta.stop_reason),
    )


# How the engine loop's refusals of a request answer on the wire (the first matching kind).
REFUSAL_STATUS = (
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


@contextlib.contextmanager
def refusals_as_status(context, metrics=None):
    """Inside: checking and submitting a request. A refusal aborts the RPC with its status (and counts it)."""
    try:
        yield
    except (Overloaded, Draining, ValueError) as error:
        code = next(code for kind, code in REFUSAL_STATUS if isinstance(error, kind))
        if metrics is not None:
            metrics.rejected.labels(code.name).inc()
        context.abort(code, str(error))


class GenerationService:
    def __init__(self):
        self.loop: EngineLoop | None = None  # set, with the limits, once the engine has warmed up
        self.limits: RequestLimits | None = None
        self.chat_template: str | None = None  # server.chat_template; None: the model's own
        self.tool_call_parser = "auto"  # server.tool_call_parser
        self.reasoning_parser = "auto"  # server.reasoning_parser: Chat's reasoning_content, GPT-OSS's harmony calls
        self.system_fingerprint = ""

    def attach(
        self,
        loop: EngineLoop,
        limits: RequestLimits,
        chat_template: str | None = None,
        system_fingerprint: str = "",
        tool_call_parser: str = "auto",
    ) -> None:
        self.limits = limits
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.system_fingerprint = system_fingerprint
        self.loop = loop

    def _ready(self, context) -> tuple[EngineLoop, RequestLimits]:
        if self.loop is None or self.limits is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "the engine is still warming up")
        return self.loop, self.limits

    def Generate(self, request: pb.GenerateRequest, context):
        loop, limits = self._ready(context)
        yield from self._stream(
            loop, context, request.request_id, request.session_id, lambda: (*checked_request(limits, request), NO_TOOLS)
        )

    def Chat(self, request: pb.ChatRequest, context):
        loop, limits = self._ready(context)

        harmony = engine_reasoning_parser(self.reasoning_parser, loop.engine)

        def checked() -> tuple[list[int], SamplingParams, ToolPlan]:
            prompt, params, plan = checked_chat(
                request, loop.engine.tokenizer, limits, self.chat_template, self.tool_call_parser
            )
            return prompt, with_grammar_after_reasoning(params, harmony, prompt), plan

        yield from self._stream(loop, context, request.request_id, request.session_id, checked, harmony)

    def _stream(self, loop: EngineLoop, context, request_id: str, session_id: str, checked, harmony=None):
        """Submit what checked() returns (prompt, params, tool plan) and yield its messages."""
        if (
            loop.engine.config.disagg.role == EngineRole.PREFILL
        ):  # it would stop at the first token: the router's Decode path only
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this replica prefills for decode replicas "
                "(engine.role prefill): send requests to a router in mode disaggregated",
            )
        with refusals_as_status(context, loop.metrics):
            prompt, params, plan = checked()
            stream = loop.submit(prompt, params, request_id, session_id or None)
        # The slot is freed (and the request aborted if still running) when the RPC ends for any reason.
        if not context.add_callback(lambda: loop.release(stream)):
            loop.release(stream)  # the RPC ended already
            return
        stream.on_expire = context.cancel

        def responses():
            for delta in stream:
                if stream.cut_off and delta.finish_reason == "abort":  # shutting down past server.drain_timeout
                    abort(context, grpc.StatusCode.UNAVAILABLE, stream.cut_off)
                yield response_from_delta(delta, stream.request_id)

        reasoning_start = reply_reasoning_start(params)
        yield from with_tool_calls(responses(), plan, harmony, prompt if harmony is not None else (), reasoning_start)

    def GetServerInfo(self, request: pb.ServerInfoRequest, context) -> pb.ServerInfo:
        loop, _ = self._ready(context)
        info, stats = loop.description, loop.stats
        shapes = [
            f"{kind}(tokens={tokens}, seqs={seqs}, pages={pages})"
            for kind, tokens, seqs, pages in info.compiled_buckets
        ]
        reply = pb.ServerInfo(
            model=info.model_name,
            dtype=info.dtype,
            mesh=info.mesh,
            page_size=info.page_size,
            num_pages=info.num_pages,
            compiled_buckets=shapes,
            max_model_len=info.max_model_len,
            version=jaxserve.__version__,
            attention_impl=info.attention_impl,
            max_num_seqs=info.max_num_seqs,
            vocab_size=info.vocab_size,
            num_free_pages=stats["kv_pages_free"],
            num_running=stats["num_running"],
            num_waiting=stats["num_waiting"],
            system_fingerprint=self.system_fingerprint,
        )
        reply.MergeFrom(router_info(info, stats))
        return reply

    def LoadLoRA(self, request: pb.LoadLoRARequest, context) -> pb.LoadLoRAResponse:
        adapter = self._on_loop(context, lambda engine: engine.load_lora(request.name, request.path))
        return pb.LoadLoRAResponse(slot=adapter.slot, rank=adapter.rank)

    def UnloadLoRA(self, request: pb.UnloadLoRARequest, context) -> pb.UnloadLoRAResponse:
        self._on_loop(context, lambda engine: engine.unload_lora(request.name))
        return pb.UnloadLoRAResponse()

    def _on_loop(self, context, function):
        """function(engine) on the engine loop's thread, between steps (it changes device state); its
        ValueError is INVALID_ARGUMENT, or FAILED_PRECONDITION where the engine has no LoRA slots."""
        loop, _ = self._ready(context)
        try:
            return loop.call(function).result()
        except ValueError as error:
            no_slots = "no LoRA slots" in str(error)
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION if no_slots else grpc.StatusCode.INVALID_ARGUMENT,
                str(error),
            )

    def _tokenizer(self, context) -> tuple[Tokenizer, RequestLimits]:
        loop, limits = self._ready(context)
        if loop.engine.tokenizer is None:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, "the model has no tokenizer")
        return loop.engine.tokenizer, limits

    def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer, limits = self._tokenizer(context)
        try:
            request_limits.check_text(limits, request.text)
        except ValueError as error:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.TokenizeResponse(token_ids=tokenizer.encode(request.text))

    def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        tokenizer, limits = self._tokenizer(context)
        vocab_size = limits.vocab_size
        try:
            request_limits.check_token_ids(limits, request.token_ids, "the request")
        except ValueError as error:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        bad = [t for t in request.token_ids if not 0 <= t < vocab_size]
        if bad:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"token ids {bad[:5]} are outside [0, {vocab_size})")
        return pb.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids), skip_special_tokens=True))
