"""A stand-in replica for the router's tests, with no engine and no JAX: it answers ServerInfo (the real
model's fingerprint, so the router accepts it), streams a snapshot and heartbeats of page events, reports
SERVING, and answers Generate and Chat with two messages (their texts set by a test), or refuses them with a
chosen gRPC code; it keeps every request it received, to show what the router forwards.
TLS and API keys go through the real server's code (jaxserve.server.auth)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.engine.fingerprint import model_fingerprint
from jaxserve.loading.model_source import open_model
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.server.auth import ApiKeyInterceptor, ApiKeys, grpc_server_credentials
from jaxserve.server.config_file import TLSConfig

SYSTEM_FINGERPRINT = "fp-fake-replica"
REPLY_TOKEN_IDS = [5, 6]


class FakeReplica(jaxserve_pb2_grpc.GenerationServicer):
    def __init__(self, model_path: str, tls: TLSConfig | None = None, api_keys: list[str] | None = None):
        source = open_model(model_path)
        self.info = pb.ServerInfo(
            model=source.name,
            page_size=16,
            num_pages=256,
            max_model_len=128,
            max_num_seqs=4,
            vocab_size=source.config.vocab_size,
            system_fingerprint=SYSTEM_FINGERPRINT,
            model_fingerprint=model_fingerprint(source),
        )
        self.refusal: tuple[grpc.StatusCode, str] | None = None  # set by a test: how Generate and Chat refuse
        self.num_requests = 0
        self.received: list = []  # every GenerateRequest and ChatRequest, as it arrived
        self.reply_texts = ("a", "b")  # the two messages' texts
        self.finish_reason = "length"  # the second's
        self._stopped = threading.Event()
        pool = futures.ThreadPoolExecutor(16)
        interceptors = [ApiKeyInterceptor(ApiKeys(api_keys), pool)] if api_keys else []
        self.server = grpc.server(pool, interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        jaxserve_pb2_grpc.add_GenerationServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for service in ("", "jaxserve.v1.Generation"):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if tls is not None:
            self.port = self.server.add_secure_port("127.0.0.1:0", grpc_server_credentials(tls))
        else:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def start(self) -> FakeReplica:
        self.server.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.server.stop(grace=None).wait()

    def GetServerInfo(self, request, context):
        return self.info

    def SubscribeKVEvents(self, request, context):
        heartbeat = (request.heartbeat_ms or 500) / 1000
        load = pb.ReplicaLoad(num_free_pages=self.info.num_pages)
        yield pb.KVEventBatch(sequence=0, snapshot=True, load=load, instance_id="fake")
        while context.is_active() and not self._stopped.wait(heartbeat):
            yield pb.KVEventBatch(sequence=0, load=load, instance_id="fake")

    def _reply(self, context):
        self.num_requests += 1
        if self.refusal is not None:
            context.abort(*self.refusal)
        first, second = self.reply_texts
        yield pb.GenerateResponse(token_ids=REPLY_TOKEN_IDS[:1], text=first, num_prompt_tokens=3)
        yield pb.GenerateResponse(
            token_ids=REPLY_TOKEN_IDS[1:], text=second, finish_reason=self.finish_reason, num_prompt_tokens=3
        )

    def Generate(self, request, context):
        self.received.append(request)
        yield from self._reply(context)

    def Chat(self, request, context):
        self.received.append(request)
        yield from self._reply(context)
