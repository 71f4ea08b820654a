"""Who may call the server: TLS (optionally mutual) and API keys sent as `authorization: Bearer KEY`.

The same ApiKeys check serves gRPC (ApiKeyInterceptor, over call metadata), the metrics endpoint,
and the OpenAI HTTP API (over the Authorization header). Health checks are exempt so that load
balancers and orchestrators need no key.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl

import grpc

from jaxserve.server.config_file import TLSConfig

# Health answers without a key: probes from load balancers and orchestrators carry none.
EXEMPT_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


class ApiKeys:
    """A set of keys, kept as SHA-256 digests and compared in constant time."""

    def __init__(self, keys: list[str]):
        if not keys:
            raise ValueError("an API key file must hold at least one key")
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        """One key per line; blank lines and lines starting with # are skipped."""
        try:
            with open(path) as f:
                lines = [line.strip() for line in f]
        except OSError as error:
            raise ValueError(f"cannot read server.api_keys {path}: {error}") from None
        keys = [line for line in lines if line and not line.startswith("#")]
        if any(any(c.isspace() for c in key) for key in keys):
            raise ValueError(f"server.api_keys {path}: a key may not contain spaces")
        return cls(keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an Authorization value ("Bearer KEY") carries one of the keys."""
        if not authorization:
            return False
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = False
        for known in self._digests:  # no early exit: the time taken says nothing about which key matched
            found |= hmac.compare_digest(digest, known)
        return found


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health checks unless its metadata carries a known key. It runs on the
    server's polling thread: a digest and a compare, never a wait."""

    def __init__(self, keys: ApiKeys, refusal_pool):
        self.keys = keys

        def refuse(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key: send metadata 'authorization: Bearer KEY'"
            )

        refuse.experimental_thread_pool = refusal_pool  # refusals never queue behind streams
        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(EXEMPT_METHOD_PREFIXES):
            return continuation(handler_call_details)
        authorization = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):  # a -bin key's value would be bytes
                authorization = value
        if self.keys.allows(authorization):
            return continuation(handler_call_details)
        return self._refusal


def read_credential(path: str, what: str) -> bytes:
    """A key, certificate or key file's bytes; ValueError naming the option (`what`) when unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error}") from None


def grpc_server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """The server's certificate; with a client CA, clients must present a certificate it signed."""
    key, cert = read_credential(tls.key, "server.tls.key"), read_credential(tls.cert, "server.tls.cert")
    client_ca = read_credential(tls.client_ca, "server.tls.client_ca") if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """The same TLS settings for an HTTP endpoint (metrics, the OpenAI API)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
        if tls.client_ca:
            context.load_verify_locations(tls.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"cannot load server.tls: {error}") from None
    return context
