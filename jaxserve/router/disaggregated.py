"""The router's disaggregated mode (router.mode: disaggregated): a prefill pool and a decode pool.

Each request goes to a decode replica, chosen by the policy within the decode pool (its cached prefix
is what need not travel), as a jaxserve.disagg.v1.Decode/Generate naming a prefill replica chosen by
the policy within the prefill pool (prefix-aware: its cached prefix is prefill not redone). The decode
replica drives the handover (jaxserve/disagg/decode_service.py) and streams the tokens, forwarded here
message by message. A Chat is rendered here (tools included) and sent as token ids, with the grammar its
tool_choice imposes; its tool calls are parsed here from the whole reply (router.tool_call_parser), and its
reasoning split out of the text (GPT-OSS: the parser server.reasoning_parser auto would pick), as a replica's
Chat would.

Faults: the prefill replica failing is the decode replica's to absorb (it recomputes the prompt); with
no prefill replica up, the decode replica prefills itself (an empty prefill_address). The decode
replica failing, even mid-stream, is the router's: the request is sent again, to another decode
replica or the same one back from a restart, as a continuation (the prompt plus the tokens the client
already has, max_tokens less those), and the client's stream goes on where it stopped. A greedy
continuation is the same tokens; a sampled one is drawn afresh from the same distribution.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc

from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.policy import Prediction, RouteRequest, replica_keys
from jaxserve.router.service import BUSY, REPLICA_FAILURES, RouterService, route_request
from jaxserve.server.grpc_chat import with_tool_calls
from jaxserve.server.reasoning_parsers import (
    ReasoningParser,
    engine_reasoning_parser,
    reply_reasoning_start,
    with_grammar_after_reasoning,
)
from jaxserve.server.sampling_proto import guided_decoding_to_proto
from jaxserve.server.service import DEFAULT_MAX_TOKENS

POLL_INTERVAL = 0.1  # seconds between looks for a decode replica back up


def model_reasoning_parser(source, name: str = "auto") -> ReasoningParser | None:
    """The reasoning parser a replica of this model (a ModelSource) picks with server.reasoning_parser `name`."""
    return engine_reasoning_parser(name, SimpleNamespace(model_config=source.config, tokenizer=source.tokenizer))


def continuation(request: pb.GenerateRequest, streamed: list[int]) -> pb.GenerateRequest:
    """The request that generates what the client has not received yet: the streamed tokens join the prompt,
    max_tokens and min_tokens count them, and the prompt's logprobs (sent with the first message) are not asked
    again."""
    if not streamed:
        return request
    following = pb.GenerateRequest()
    following.CopyFrom(request)
    following.token_ids.extend(streamed)
    following.sampling.max_tokens = (request.sampling.max_tokens or DEFAULT_MAX_TOKENS) - len(streamed)
    following.sampling.min_tokens = max(0, request.sampling.min_tokens - len(streamed))
    following.sampling.ClearField("prompt_logprobs")
    # the router sent the prompt truncated already (truncate_prompt_tokens): cut again, prompt + streamed would
    # lose the prompt's start, and the client's count (num_prompt_tokens less the streamed) would be wrong
    following.sampling.ClearField("truncate_prompt_tokens")
    return following


def inexact_continuation(sampling: pb.SamplingParams) -> str:
    """Why a continuation (streamed tokens as prompt) would not generate what the request would have, or "": a
    grammar restarts from its beginning, and presence / frequency penalties count only the continuation's own
    outputs."""
    if sampling.HasField("guided_decoding"):
        return "its guided decoding cannot resume mid-output on another replica"
    if sampling.presence_penalty or sampling.frequency_penalty:
        return "its presence / frequency penalties cannot resume mid-output on another replica"
    return ""


class DisaggregatedRouterService(RouterService):
    def __init__(
        self,
        prefill_replicas: list,
        decode_replicas: list,
        policy,
        tokenizer,
        limits,
        metrics,
        max_in_flight: int,
        max_resends: int,
        resend_wait: float,
        tool_call_parser: str = "auto",
    ):
        super().__init__(
            prefill_replicas + decode_replicas,
            policy,
            tokenizer,
            limits,
            metrics,
            max_in_flight,
            max_resends,
            tool_call_parser,
        )
        self.prefill_replicas = prefill_replicas
        self.decode_replicas = decode_replicas
        self.resend_wait = resend_wait
        # the decode replica answers a Generate: the reply's reasoning is split here (model_reasoning_parser)
        self.reasoning: ReasoningParser | None = None

    def Chat(self, request: pb.ChatRequest, context):
        """The decode replica gets token ids (a Generate): tool_choice's grammar travels in the sampling, and
        the calls are parsed here onto each completion's last message."""
        try:
            token_ids, params, plan = self.checked_chat(request)
        except ValueError as error:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        params = with_grammar_after_reasoning(params, self.reasoning, token_ids)
        forwarded = pb.ChatRequest()
        forwarded.CopyFrom(request)
        guide = guided_decoding_to_proto(plan.guided_decoding)
        if guide is not None:
            forwarded.sampling.guided_decoding.CopyFrom(guide)
        if params.guided_decoding_after_token is not None:  # the grammar waits for the reasoning to end
            forwarded.sampling.guided_decoding_after_token = params.guided_decoding_after_token
        responses = self._serve("Chat", forwarded, route_request(token_ids, forwarded), context)
        try:
            yield from with_tool_calls(responses, plan, self.reasoning, token_ids, reply_reasoning_start(params))
        finally:
            responses.close()

    def _choose_decode(self, route: RouteRequest, tried: dict[str, int], wait: bool, context) -> Prediction | None:
        """A decode replica not tried yet, or tried but back from a restart (up on a newer subscription);
        when none is and wait is set, the first to be so within resend_wait."""
        deadline = time.monotonic() + (self.resend_wait if wait else 0.0)
        while True:
            excluded = {
                r.address for r in self.decode_replicas if r.address in tried and r.num_snapshots <= tried[r.address]
            }
            chosen = self._choose_in(self.decode_replicas, route, excluded)
            if chosen is not None or time.monotonic() >= deadline or not context.is_active():
                return chosen
            time.sleep(POLL_INTERVAL)

    def _route(self, method: str, request, route: RouteRequest, context):
        if request.sampling.n > 1:
            self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"disaggregated serving hands over one sequence per request (n = 1), got n = {request.sampling.n}",
            )
        original = pb.GenerateRequest(
            request_id=request.request_id,
            token_ids=route.token_ids,
            sampling=request.sampling,
            session_id=request.session_id,
        )
        streamed: list[int] = []  # the tokens the client has received
        tried, last_error = {}, ""  # decode replicas that failed: their snapshot count then
        for _ in range(self.max_resends + 1):
            inexact = inexact_continuation(original.sampling) if streamed else ""
            if inexact:  # failed with the reason rather than continued into a different output
                self._refuse(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"the decode replica failed after {len(streamed)} tokens ({last_error}); {inexact}",
                )
            forwarded = continuation(original, streamed)
            now = RouteRequest(
                list(forwarded.token_ids), request.session_id, route.max_new_tokens - len(streamed), lora=route.lora
            )
            decode = self._choose_decode(now, tried, bool(tried) and not last_error.startswith(BUSY.name), context)
            if decode is None:
                break
            prefill = self._choose_in(self.prefill_replicas, now, set())
            last_error = yield from self._forward_pair(forwarded, now, prefill, decode, streamed, context)
            if last_error is None or not context.is_active():
                return
            tried[decode.replica.address] = decode.replica.num_snapshots
            self.metrics.resends.labels(last_error.split(":")[0]).inc()
        down = "; ".join(f"{r.address}: {r.down_reason}" for r in self.replicas if not r.is_up)
        busy = last_error.startswith(BUSY.name)
        self._refuse(
            context,
            BUSY if busy else grpc.StatusCode.UNAVAILABLE,
            f"no decode replica could take the request (tried {len(tried)}"
            f"{': ' + last_error if last_error else ''}){'; down: ' + down if down else ''}",
        )

    def _forward_pair(
        self,
        request: pb.GenerateRequest,
        route: RouteRequest,
        prefill: Prediction | None,
        decode: Prediction,
        streamed: list[int],
        context,
    ):
        """One attempt; returns None when done (or the client left), else why to send it again. Tokens
        forwarded are appended to streamed."""
        replica, labels = decode.replica, (decode.replica.address,)
        for chosen in (prefill, decode):
            if chosen is not None:
                chosen.replica.view.note_routed(replica_keys(chosen.replica, route))
        self.metrics.requests.labels(*labels).inc()
        num_resent = len(streamed)
        sent_at, waiting_first = time.perf_counter(), True
        call = disagg_pb2_grpc.DecodeStub(replica.channel).Generate(
            dpb.DecodeRequest(request=request, prefill_address=prefill.replica.address if prefill is not None else "")
        )
        context.add_callback(call.cancel)
        replica.routed(call, decode)
        try:
            for response in call:
                if waiting_first:
                    if not response.token_ids and response.finish_reason in ("abort", "error"):
                        return f"{response.finish_reason}: replica {replica.address} ended the request unstarted"
                    waiting_first = False
                    replica.started(call, decode)
                    if not num_resent:
                        self._observe_first(decode, response, time.perf_counter() - sent_at, len(route.token_ids))
                response.num_prompt_tokens -= num_resent  # as the client's prompt counts
                streamed.extend(response.token_ids)
                yield response
            return None
        except grpc.RpcError as error:
            reason = f"{error.code().name}: replica {replica.address}: {error.details()}"
            if not context.is_active():
                return None
            if error.code() in REPLICA_FAILURES:
                replica.report_failure(reason)
                if not waiting_first:
                    self.metrics.broken_streams.labels(*labels).inc()
            elif error.code() != BUSY:
                context.abort(error.code(), error.details())  # the request's own fault: the same anywhere
            return reason
        finally:
            if waiting_first:
                replica.started(call, decode)
            replica.finished(call)
