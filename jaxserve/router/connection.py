"""How the router reaches its replicas when they require TLS or an API key (router.replica_tls,
router.replica_api_key): one channel per replica carries both, so that every call on it (ServerInfo, page
events, health, forwarded streams, disaggregated handovers) is authenticated alike.

The key goes as `authorization: Bearer KEY` metadata, added by a channel interceptor, as jaxserve.client
sends it; health checks carry it too (the replica ignores it there).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import grpc

from jaxserve.client import Connection, first_api_key
from jaxserve.server.auth import read_credential

PLAIN = Connection()  # replicas that require neither TLS nor a key


@dataclass(frozen=True)
class ReplicaTLS:
    ca: str  # PEM: the CA that signed the replicas' certificates (turns TLS to the replicas on)
    cert: str | None = None  # PEM: the router's own certificate, for replicas that require one (server.tls.client_ca)
    key: str | None = None  # PEM: its private key

    @classmethod
    def parse(cls, value) -> ReplicaTLS | None:
        if value is None or isinstance(value, ReplicaTLS):
            return value
        names = set(value) if isinstance(value, dict) else set()
        if "ca" not in names or names - {"ca", "cert", "key"} or ("cert" in names) != ("key" in names):
            raise ValueError(
                f"router.replica_tls must be a mapping with ca, and cert with key for mutual TLS, got {value!r}"
            )
        return cls(**{name: str(path) for name, path in value.items()})


def replica_connection(tls: ReplicaTLS | None, api_key_file: str | None) -> Connection:
    """The files read once, at start-up; ValueError naming the option when one cannot be read."""
    api_key = None
    if api_key_file is not None:
        text = read_credential(api_key_file, "router.replica_api_key").decode()
        api_key = first_api_key(text, f"router.replica_api_key {api_key_file}")
    if tls is None:
        return Connection(api_key=api_key)
    return Connection(
        api_key=api_key,
        root_certificates=read_credential(tls.ca, "router.replica_tls.ca"),
        private_key=read_credential(tls.key, "router.replica_tls.key") if tls.key else None,
        certificate_chain=read_credential(tls.cert, "router.replica_tls.cert") if tls.cert else None,
    )


class _CallDetails(
    namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = tuple(details.metadata or ()) + self.metadata
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def replica_channel(address: str, connection: Connection, options=()) -> grpc.Channel:
    channel = (
        grpc.secure_channel(address, connection.credentials(), options=list(options))
        if connection.uses_tls
        else grpc.insecure_channel(address, options=list(options))
    )
    if connection.api_key:
        return grpc.intercept_channel(channel, _BearerInterceptor(connection.metadata))
    return channel
