"""The jaxserve.v1.Generation service in front of replicas: each Generate or Chat is checked, tokenized
here (the page keys need token ids), routed by the policy, and its stream forwarded message by message.

A request that fails before its first message (the replica died, was taken out, refused it for load)
is sent again to another replica, up to max_resends times, so none is lost. Once a message has been
forwarded the stream cannot move (the client has seen tokens): it ends UNAVAILABLE with the reason.
Errors that are the request's own (INVALID_ARGUMENT, ...) pass through unchanged.
"""

from __future__ import annotations

import threading
import time

import grpc

import jaxserve
from jaxserve.host.request import SamplingParams, truncate_prompt
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.policy import Prediction, RouteRequest, replica_keys, with_adapter
from jaxserve.server import limits as request_limits
from jaxserve.server.grpc_chat import checked_chat
from jaxserve.server.service import DEFAULT_MAX_TOKENS, checked_request
from jaxserve.server.tool_choice import ToolPlan

# The replica is broken (dead, unreachable, taken out: CANCELLED by the router itself): take it out, re-send.
REPLICA_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED  # the replica is full: re-send, but it stays in


def route_request(token_ids: list[int], request) -> RouteRequest:
    """What the policy needs of a GenerateRequest or ChatRequest: its prompt and what it may grow by."""
    sampling = request.sampling
    max_new_tokens = (sampling.max_tokens or DEFAULT_MAX_TOKENS) * max(sampling.n, 1)
    return RouteRequest(token_ids, request.session_id, max_new_tokens, lora=sampling.lora)


class RouterService:
    def __init__(
        self,
        replicas: list,
        policy,
        tokenizer,
        limits,
        metrics,
        max_in_flight: int,
        max_resends: int,
        tool_call_parser: str = "auto",
    ):
        self.replicas = replicas
        self.policy = policy
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.max_resends = max_resends
        self.tool_call_parser = tool_call_parser  # router.tool_call_parser
        self._lock = threading.Lock()
        self.num_in_flight = 0
        self.draining = False  # shutting down: new requests are refused UNAVAILABLE, those in flight go on

    def choose(self, route: RouteRequest, exclude: set[str]) -> Prediction | None:
        return self._choose_in(self.replicas, route, exclude)

    def _choose_in(self, pool: list, route: RouteRequest, exclude: set[str]) -> Prediction | None:
        """The policy's choice among the pool's replicas that are up, not excluded and hold the request's adapter."""
        candidates = with_adapter(route, [r for r in pool if r.is_up and r.address not in exclude])
        return self.policy.choose(route, candidates) if candidates else None

    def _refuse(self, context, code: grpc.StatusCode, message: str):
        self.metrics.rejected.labels(code.name).inc()
        context.abort(code, message)

    # -- the streaming methods --------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context):
        try:
            prompt, params = checked_request(self.limits, request)
            # the prompt the replica uses (truncate_prompt_tokens): what is checked, routed and sent
            token_ids = truncate_prompt(
                self.tokenize_prompt(prompt), params.truncate_prompt_tokens, self.limits.max_prompt_tokens
            )
            request_limits.check_token_ids(self.limits, token_ids, "the prompt")
        except ValueError as error:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.token_ids[:] = token_ids  # tokenized once, here: the replica need not again
        forwarded.ClearField("text")
        yield from self._serve("Generate", forwarded, route_request(token_ids, request), context)

    def Chat(self, request: pb.ChatRequest, context):
        """Rendered here, tools included, only to know the prompt's pages; the request goes on unchanged:
        the replica renders it again (with its own server.chat_template if it has one), applies tool_choice's
        grammar and parses the reply's tool calls."""
        try:
            token_ids, _, _ = self.checked_chat(request)
        except ValueError as error:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        yield from self._serve("Chat", request, route_request(token_ids, request), context)

    def checked_chat(self, request: pb.ChatRequest) -> tuple[list[int], SamplingParams, ToolPlan]:
        """The prompt as a replica without a chat template of its own renders it, its sampling params and
        tool plan, after the same checks (the server's caps, the tools, tool_choice); ValueError."""
        return checked_chat(request, self.tokenizer, self.limits, None, self.tool_call_parser)

    def tokenize_prompt(self, prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer; send token_ids")
        return self.tokenizer.encode(prompt)

    def _serve(self, method: str, request, route: RouteRequest, context):
        with self._lock:
            if self.draining:
                self._refuse(context, grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
            if self.num_in_flight >= self.max_in_flight:
                self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.num_in_flight} requests in flight, the router's limit is {self.max_in_flight}",
                )
            self.num_in_flight += 1
            self.metrics.in_flight.set(self.num_in_flight)
        try:
            yield from self._route(method, request, route, context)
        finally:
            with self._lock:
                self.num_in_flight -= 1
                self.metrics.in_flight.set(self.num_in_flight)

    def _route(self, method: str, request, route: RouteRequest, context):
        tried, last_error = set(), ""
        for _ in range(self.max_resends + 1):
            prediction = self.choose(route, tried)
            if prediction is None:
                break
            last_error = yield from self._forward(method, request, route, prediction, context)
            if last_error is None or not context.is_active():
                return
            tried.add(prediction.replica.address)
            self.metrics.resends.labels(last_error.split(":")[0]).inc()
        down = "; ".join(f"{r.address}: {r.down_reason}" for r in self.replicas if not r.is_up)
        busy = last_error.startswith(BUSY.name)  # every replica tried was full: the client may retry later
        self._refuse(
            context,
            BUSY if busy else grpc.StatusCode.UNAVAILABLE,
            f"no replica could take the request (tried {len(tried)}{': ' + last_error if last_error else ''})"
            f"{'; down: ' + down if down else ''}",
        )

    def _forward(self, method: str, request, route: RouteRequest, prediction: Prediction, context):
        """Stream one attempt; returns None when done (or the client left), else why to try another replica."""
        replica, labels = prediction.replica, (prediction.replica.address,)
        replica.view.note_routed(replica_keys(replica, route))  # the blind window: hits before the events say so
        self.metrics.requests.labels(*labels).inc()
        self.metrics.predicted_ttft.labels(*labels).observe(prediction.ttft)
        sent_at, waiting_first = time.perf_counter(), True
        call = getattr(replica.stub, method)(request)
        context.add_callback(call.cancel)
        replica.routed(call, prediction)
        try:
            for response in call:
                if waiting_first:
                    if not response.token_ids and response.finish_reason in ("abort", "error"):
                        return f"{response.finish_reason}: replica {replica.address} ended the request unstarted"
                    waiting_first = False
                    replica.started(call, prediction)
                    self._observe_first(prediction, response, time.perf_counter() - sent_at, len(route.token_ids))
                yield response
            return None
        except grpc.RpcError as error:
            reason = f"{error.code().name}: replica {replica.address}: {error.details()}"
            if not context.is_active():
                return None
            if not waiting_first:
                self.metrics.broken_streams.labels(*labels).inc()
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the replica serving this stream failed: {reason}")
            if error.code() in REPLICA_FAILURES:
                replica.report_failure(reason)
            elif error.code() != BUSY:
                context.abort(error.code(), error.details())  # the request's own fault: the same anywhere
            return reason
        finally:
            if waiting_first:
                replica.started(call, prediction)
            replica.finished(call)

    def _observe_first(self, prediction: Prediction, response, ttft: float, num_prompt_tokens: int) -> None:
        labels = (prediction.replica.address,)
        self.metrics.observed_ttft.labels(*labels).observe(ttft)
        self.metrics.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.metrics.predicted_hit_tokens.labels(*labels).inc(prediction.num_hit_tokens)
        self.metrics.hit_tokens.labels(*labels).inc(response.num_cached_tokens)

    # -- the unary methods ------------------------------------------------------------------------

    def GetServerInfo(self, request: pb.ServerInfoRequest, context) -> pb.ServerInfo:
        """The first live replica's description, with the load summed over all live ones."""
        live = [r for r in self.replicas if r.is_up and r.info is not None]
        if not live:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is up")
        info = pb.ServerInfo()
        info.CopyFrom(live[0].info)
        info.version = jaxserve.__version__
        info.num_pages = sum(r.info.num_pages for r in live)
        info.num_free_pages = sum(r.load.num_free_pages for r in live)
        info.num_running = sum(r.load.num_running for r in live)
        info.num_waiting = sum(r.load.num_waiting for r in live)
        info.num_tokens_waiting_prefill = sum(r.load.num_tokens_waiting_prefill for r in live)
        info.instance_id = ""
        return info

    def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            request_limits.check_text(self.limits, request.text)
            token_ids = self.tokenize_prompt(request.text)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            raise  # abort raises; a type checker cannot know
        return pb.TokenizeResponse(token_ids=token_ids)

    def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        tokenizer = self.tokenizer
        if tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the model has no tokenizer")
            raise RuntimeError("unreachable: abort raises")
        try:
            request_limits.check_token_ids(self.limits, request.token_ids, "the request")
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        bad = [t for t in request.token_ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token ids {bad[:5]} are outside [0, {self.limits.vocab_size})"
            )
        return pb.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids), skip_special_tokens=True))
