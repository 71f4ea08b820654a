"""The jaxserve.disagg.v1 services on a replica's gRPC server (jaxserve/proto/disagg.proto): Prefill on a
prefill replica, Decode on a decode replica; Status on both. Registered on every replica (the handlers
must exist before the server starts); a replica of another role answers FAILED_PRECONDITION. Each
replica with a role runs one JAX transfer server and a timer that expires abandoned handovers."""

from __future__ import annotations

import threading
from typing import TypeVar

import grpc

from jaxserve.config import EngineRole
from jaxserve.disagg.decode_service import DecodeService
from jaxserve.disagg.page_transfers import PageTransfers
from jaxserve.disagg.prefill_service import PrefillService
from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server.rpc import _server_stream, _unary, abort

PREFILL_SERVICE = "jaxserve.disagg.v1.Prefill"
DECODE_SERVICE = "jaxserve.disagg.v1.Decode"
EXPIRY_INTERVAL = 1.0  # seconds between looks for handovers past their timeout
Side = TypeVar("Side")  # the Prefill or the Decode service, or either


class DisaggService:
    def __init__(self):
        self.loop = None
        self.prefill: PrefillService | None = None
        self.decode: DecodeService | None = None
        self.transfers: PageTransfers | None = None
        self._stopped = threading.Event()
        self._timer: threading.Thread | None = None

    def handlers(self, pools) -> list[grpc.GenericRpcHandler]:
        return [
            grpc.method_handlers_generic_handler(
                PREFILL_SERVICE,
                {
                    "Prefill": _unary(self.Prefill, dpb.PrefillRequest, dpb.PrefillResponse, pools.streams),
                    "Release": _unary(self.Release, dpb.ReleaseRequest, dpb.ReleaseResponse, pools.quick),
                    "Status": _unary(self.Status, dpb.StatusRequest, dpb.StatusResponse, pools.quick),
                },
            ),
            grpc.method_handlers_generic_handler(
                DECODE_SERVICE,
                {
                    "Generate": _server_stream(self.Generate, dpb.DecodeRequest, pb.GenerateResponse, pools.streams),
                    "Status": _unary(self.Status, dpb.StatusRequest, dpb.StatusResponse, pools.quick),
                },
            ),
        ]

    def attach(self, loop, limits, transfer_host: str = "127.0.0.1") -> None:
        """Once the engine is warm; nothing to do for a replica of role both."""
        config = loop.engine.config
        if config.disagg.role == EngineRole.BOTH:
            return
        self.transfers = PageTransfers(transfer_host)
        if config.disagg.role == EngineRole.PREFILL:
            self.prefill = PrefillService(loop, self.transfers, config.disagg.handover_timeout)
        else:
            self.decode = DecodeService(loop, limits, self.transfers, config.disagg.handover_timeout)
        self.loop = loop
        self._timer = threading.Thread(target=self._expire_forever, name="disagg-expiry", daemon=True)
        self._timer.start()

    def stop(self) -> None:
        self._stopped.set()
        if self.decode is not None:
            self.decode.close()

    def _expire_forever(self) -> None:
        side = self.prefill or self.decode
        assert side is not None  # attach starts this timer once it has made one
        while not self._stopped.wait(EXPIRY_INTERVAL):
            side.expire()

    def _side(self, context, side: Side | None) -> Side:
        if side is None:
            role = self.loop.engine.config.disagg.role if self.loop is not None else "not warmed up yet"
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"this replica's role is {role}")
        return side

    def Prefill(self, request, context):
        return self._side(context, self.prefill).Prefill(request, context)

    def Release(self, request, context):
        return self._side(context, self.prefill).Release(request, context)

    def Generate(self, request, context):
        yield from self._side(context, self.decode).Generate(request, context)

    def Status(self, request, context) -> dpb.StatusResponse:
        side = self._side(context, self.prefill or self.decode)
        return side.loop.call(lambda engine: self._status(side, engine)).result(10.0)

    def _status(self, side: PrefillService | DecodeService, engine) -> dpb.StatusResponse:
        """On the loop thread."""
        reply, stats = side.status(engine), engine.stats()
        reply.role, reply.serving, reply.transfer_address = engine.config.disagg.role, True, side.transfers.address
        reply.num_free_pages, reply.num_pages = stats["kv_pages_free"], stats["kv_pages_total"]
        reply.num_compiles_after_warmup = stats["num_compiles_after_warmup"]
        return reply
