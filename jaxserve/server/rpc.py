"""gRPC plumbing: every method parses its own request bytes and runs on a thread pool of its kind.

Parsing in the method turns bytes that are not the expected message (or hold invalid UTF-8) into
INVALID_ARGUMENT with the reason, where gRPC's own deserializer answers INTERNAL and logs a
traceback. Separate pools give each kind of call its own capacity: streams hold a thread each for
as long as they last, and could otherwise take every thread that health checks need. The pools are
sized from the limits: one thread per in-flight stream plus a few to refuse the excess quickly.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server.limits import check_request_size

GENERATION_SERVICE = "jaxserve.v1.Generation"
HEALTH_SERVICE = "grpc.health.v1.Health"
STREAM_REFUSAL_THREADS = 8  # beyond the in-flight streams: refusing the excess must not wait for a stream
QUICK_THREADS = 4  # health checks, server info, API-key refusals
TOKENIZER_THREADS = 2
DEFAULT_THREADS = 2  # anything registered without a pool of its own


@dataclass
class ThreadPools:
    streams: futures.ThreadPoolExecutor
    quick: futures.ThreadPoolExecutor
    tokenizer: futures.ThreadPoolExecutor
    default: futures.ThreadPoolExecutor

    @classmethod
    def for_limits(cls, max_in_flight: int) -> ThreadPools:
        def pool(size: int, name: str) -> futures.ThreadPoolExecutor:
            return futures.ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"jaxserve-{name}")

        return cls(
            streams=pool(max_in_flight + STREAM_REFUSAL_THREADS, "stream"),
            quick=pool(QUICK_THREADS, "quick"),
            tokenizer=pool(TOKENIZER_THREADS, "tokenizer"),
            default=pool(DEFAULT_THREADS, "grpc"),
        )

    def shutdown(self) -> None:
        for pool in (self.streams, self.quick, self.tokenizer, self.default):
            pool.shutdown(wait=False, cancel_futures=True)


def abort(context, code: grpc.StatusCode, message: str) -> NoReturn:
    """context.abort, typed as what it does: grpc ends the call by raising from it."""
    context.abort(code, message)
    raise AssertionError("grpc's context.abort returned")


def parse(request_type, request_bytes: bytes, context, max_bytes: int | None = None):
    """The request message, or INVALID_ARGUMENT naming what is wrong with the bytes. A request over
    max_bytes is refused unparsed: parsing megabytes only to refuse them would cost every client."""
    try:
        if max_bytes is not None:
            check_request_size(len(request_bytes), max_bytes)
        return request_type.FromString(request_bytes)
    except DecodeError as error:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.DESCRIPTOR.full_name}: {error}")
    except ValueError as error:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))


def _no_limit() -> None:
    return None


def _unary(method, request_type, response_type, pool, max_bytes=_no_limit):
    def handle(request_bytes, context):
        return method(parse(request_type, request_bytes, context, max_bytes()), context)

    handle.experimental_thread_pool = pool  # read by grpc's sync server: this method runs on `pool`
    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=response_type.SerializeToString)


def _server_stream(method, request_type, response_type, pool, max_bytes=_no_limit):
    def handle(request_bytes, context):
        return method(parse(request_type, request_bytes, context, max_bytes()), context)

    handle.experimental_thread_pool = pool
    return grpc.unary_stream_rpc_method_handler(handle, response_serializer=response_type.SerializeToString)


def generation_handler(service, pools: ThreadPools) -> grpc.GenericRpcHandler:
    """service.limits is None until the engine has warmed up (and the service then refuses anyway)."""

    def size_limit(name: str):
        return lambda: getattr(service.limits, name) if service.limits is not None else None

    return grpc.method_handlers_generic_handler(
        GENERATION_SERVICE,
        {
            "Generate": _server_stream(
                service.Generate,
                pb.GenerateRequest,
                pb.GenerateResponse,
                pools.streams,
                size_limit("max_generate_request_bytes"),
            ),
            # a conversation's text is held to the same caps as a prompt's, so the same bound holds
            "Chat": _server_stream(
                service.Chat,
                pb.ChatRequest,
                pb.GenerateResponse,
                pools.streams,
                size_limit("max_generate_request_bytes"),
            ),
            "GetServerInfo": _unary(service.GetServerInfo, pb.ServerInfoRequest, pb.ServerInfo, pools.quick),
            "LoadLoRA": _unary(service.LoadLoRA, pb.LoadLoRARequest, pb.LoadLoRAResponse, pools.quick),
            "UnloadLoRA": _unary(service.UnloadLoRA, pb.UnloadLoRARequest, pb.UnloadLoRAResponse, pools.quick),
            "Tokenize": _unary(
                service.Tokenize,
                pb.TokenizeRequest,
                pb.TokenizeResponse,
                pools.tokenizer,
                size_limit("max_tokenize_request_bytes"),
            ),
            "Detokenize": _unary(
                service.Detokenize,
                pb.DetokenizeRequest,
                pb.DetokenizeResponse,
                pools.tokenizer,
                size_limit("max_detokenize_request_bytes"),
            ),
        },
    )


def health_handler(servicer, pools: ThreadPools) -> grpc.GenericRpcHandler:
    """grpc_health's HealthServicer behind parsing and the quick pool. Watch does not hold a thread
    (its updates are pushed by HealthServicer.set), so it shares the quick pool too."""

    def watch(request_bytes, context, send_response_callback=None):
        request = parse(health_pb2.HealthCheckRequest, request_bytes, context)
        return servicer.Watch(request, context, send_response_callback=send_response_callback)

    watch.experimental_non_blocking = True
    watch.experimental_thread_pool = pools.quick
    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(
        HEALTH_SERVICE,
        {
            "Check": _unary(servicer.Check, health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse, pools.quick),
            "Watch": grpc.unary_stream_rpc_method_handler(watch, response_serializer=serialize),
        },
    )
