"""The Prometheus endpoint (`/metrics`), under the same TLS and API keys as the gRPC port.

A thread per connection; the TLS handshake happens on that thread (not in accept), and a
connection idle for CONNECTION_TIMEOUT seconds is closed, so one silent client cannot stall it.
"""

from __future__ import annotations

import socket
import ssl
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from jaxserve.server.address import bare_host
from jaxserve.server.auth import ApiKeys

CONNECTION_TIMEOUT = 10.0


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT

    def log_message(self, format, *args):  # noqa: A002 (the base class's signature): no log per scrape
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def require_api_key(app, keys: ApiKeys):
    """A WSGI app that answers 401 unless the Authorization header carries one of the keys."""

    def guarded(environ, start_response):
        if keys.allows(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or unknown API key: send 'Authorization: Bearer KEY'\n"]

    return guarded


def start_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    tls: ssl.SSLContext | None = None,
    api_keys: ApiKeys | None = None,
) -> WSGIServer:
    app = make_wsgi_app(registry)
    if api_keys is not None:
        app = require_api_key(app, api_keys)
    host = bare_host(host)
    server_class = type(
        "MetricsServer", (_ThreadingServer,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET}
    )
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="jaxserve-metrics", daemon=True).start()
    return server


def stop_metrics_server(server: WSGIServer) -> None:
    """Stop serving and close the listening socket (shutdown alone leaves the port bound)."""
    server.shutdown()
    server.server_close()
