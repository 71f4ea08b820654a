"""The OpenAI HTTP API in front of the replicas: server/openai's app, unchanged, over a `RoutedLoop`, which
offers what those handlers use of an EngineLoop (submit, release, description, engine.tokenizer, draining,
max_in_flight)
but sends each prompt through the router's gRPC forwarding (RouterService.Generate: routed by the policy,
re-sent if its replica fails before the first token) on a thread of its own, turning the forwarded messages
back into the stream's deltas. The handlers tokenize and render chats with the router's tokenizer (tools
included), so the router sees token ids, as it needs to; every SamplingParams field goes to the replica
(sampling_params_to_proto), the grammar a chat's tool_choice or response_format adds included, and the
handlers parse tool calls out of the replies with router.tool_call_parser.

A refusal the router can make itself is an HTTP status at once: an empty or too long prompt 400, the
router's max_in_flight reached 429. One that only a replica makes (or the router's
forwarding, after resends) arrives as the stream's error, with the HTTP status its gRPC code stands for
(HTTP_STATUS): the response's status when not streamed, the code of the error event when streamed (the
response has begun by then). system_fingerprint is the replicas' own (RoutedContext).
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import grpc

from jaxserve.host.request import FinishReason, SamplingParams, truncate_prompt
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.metrics import RouterMetrics
from jaxserve.server.engine_loop import Overloaded
from jaxserve.server.openai.context import ServingContext
from jaxserve.server.request_stream import Delta, RequestStream
from jaxserve.server.sampling_proto import logprobs_from_message, sampling_params_to_proto

# What a gRPC refusal (a replica's, passed through, or the router's own) answers over HTTP.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}  # anything else (INTERNAL, UNKNOWN, DATA_LOSS): 500


def replicas_fingerprint(replicas) -> str:
    """The system_fingerprint the replicas that are up report; replicas that disagree (a rolling update)
    give each of theirs, sorted and comma-separated; none up yet: empty."""
    fingerprints = {r.info.system_fingerprint for r in replicas if r.is_up and r.info is not None}
    return ",".join(sorted(fingerprints))


class RoutedContext(ServingContext):
    """The OpenAI app's context in the router: system_fingerprint is read from the replicas on every use."""

    def __init__(self, metrics: RouterMetrics, replicas: list):
        super().__init__(metrics)  # RouterMetrics is a RefusalMetrics (server/openai/loop.py)
        self.replicas = replicas

    @property
    def system_fingerprint(self) -> str:
        return replicas_fingerprint(self.replicas)

    @system_fingerprint.setter
    def system_fingerprint(self, value: str) -> None:
        """ServingContext sets an engine's; the router has none of its own."""


class RelayAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class RelayContext:
    """The part of a grpc.ServicerContext that RouterService uses, for a call made from this process."""

    def __init__(self):
        self._active = True
        self._callbacks = []
        self._lock = threading.Lock()

    def is_active(self) -> bool:
        return self._active

    def add_callback(self, callback) -> bool:
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
                return True
        return False

    def abort(self, code: grpc.StatusCode, details: str):
        raise RelayAbort(code, details)

    def cancel(self) -> None:
        with self._lock:
            self._active, callbacks = False, self._callbacks
            self._callbacks = []
        for callback in callbacks:
            callback()


def delta_from_response(response: pb.GenerateResponse) -> Delta:
    logprobs = [logprobs_from_message(entry) for entry in response.logprobs] if response.logprobs else None
    delta = Delta(
        list(response.token_ids),
        response.text,
        logprobs,
        response.finish_reason or None,
        response.num_prompt_tokens,
        response.num_cached_tokens,
        response.index,
    )
    which = response.WhichOneof("stop_reason")
    delta.stop_reason = getattr(response, which) if which is not None else None
    if response.prompt_logprobs:  # prompt tokens 2..N (the first has none); the HTTP handlers know the ids
        delta.prompt_logprobs = [None] + [logprobs_from_message(entry) for entry in response.prompt_logprobs]
    return delta


class RoutedLoop:
    def __init__(self, service, description, tokenizer, model_config=None):
        self.service = service  # a RouterService
        self.description = description  # model_name, max_model_len, max_num_seqs
        # model_config's model_type: the reasoning parser server.reasoning_parser auto picks (GPT-OSS's harmony)
        self.engine = SimpleNamespace(tokenizer=tokenizer, model_config=model_config)
        self.max_in_flight = service.max_in_flight
        self._handles = itertools.count()
        self._relays: dict[str, RelayContext] = {}
        self._lock = threading.Lock()

    @property
    def draining(self) -> bool:
        return self.service.draining

    @property
    def num_open(self) -> int:
        """HTTP calls admitted whose response has not ended (released)."""
        with self._lock:
            return len(self._relays)

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str = "", session_id: str | None = None
    ) -> RequestStream:
        """Check what the router can, then forward on a thread of its own; raises ValueError."""
        if self.service.num_in_flight >= self.max_in_flight:
            raise Overloaded(
                f"{self.service.num_in_flight} requests in flight, the router's limit is {self.max_in_flight}"
            )
        # as the replica uses it (truncate_prompt_tokens): a text prompt is tokenized here
        token_ids = truncate_prompt(
            self.service.tokenize_prompt(prompt), params.truncate_prompt_tokens, self.description.max_model_len
        )
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) + params.max_new_tokens > self.description.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is more than "
                f"max_model_len ({self.description.max_model_len})"
            )
        request = pb.GenerateRequest(
            request_id=request_id,
            token_ids=token_ids,
            sampling=sampling_params_to_proto(params),
            session_id=session_id or "",
        )
        stream = RequestStream(f"{request_id}#{next(self._handles)}", request_id, params, len(token_ids))
        relay = RelayContext()
        with self._lock:
            self._relays[stream.handle] = relay
        threading.Thread(
            target=self._relay, args=(request, stream, relay), name="router-http-relay", daemon=True
        ).start()
        return stream

    def release(self, stream: RequestStream) -> None:
        """The HTTP call has ended: cancel the forwarded call if it still runs."""
        with self._lock:
            relay = self._relays.pop(stream.handle, None)
        if relay is not None:
            relay.cancel()

    def _relay(self, request: pb.GenerateRequest, stream: RequestStream, relay: RelayContext) -> None:
        try:
            for response in self.service.Generate(request, relay):
                stream.put(delta_from_response(response))
        except RelayAbort as error:
            stream.error_status = HTTP_STATUS.get(error.code, 500)
            stream.finish(FinishReason.ERROR, error.details)
        except grpc.RpcError as error:  # cancelled by release: nobody reads any more
            stream.finish(FinishReason.ABORT, str(error.code()))
        finally:
            if not stream.finished:
                stream.finish(FinishReason.ABORT)
