"""uvicorn on an event-loop thread of its own, in the server's process.

The gRPC server is grpc's thread-pool server, not asyncio, so there is no asyncio loop to share:
uvicorn runs its own on this thread, and its handlers feed the same EngineLoop as the gRPC threads
(submit and release are thread-safe; deltas come back through RequestStream.on_put). The socket is
bound here, before uvicorn starts, so that a port in use is the same start-up error as for gRPC.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import uvicorn

from jaxserve.server.address import bare_host, host_port
from jaxserve.server.config_file import TLSConfig
from jaxserve.server.openai.streams import StreamExpired

logger = logging.getLogger(__name__)
START_TIMEOUT = 30.0  # seconds for uvicorn to start serving on its bound socket
GRACEFUL_SHUTDOWN = 5  # seconds open connections get after a drain before they are closed


class _ExpiredStreams(logging.Filter):
    """Drops uvicorn's traceback for a response cut off by the stream idle timeout: the engine loop has
    logged that one line already, and uvicorn closing the connection is the intended end."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamExpired))


EXPIRED_STREAMS = _ExpiredStreams()  # one instance: adding it again (a second server) is a no-op


def bind(host: str, port: int) -> socket.socket:
    address = bare_host(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, port), family=family, backlog=2048)
    except OSError as error:
        raise ValueError(f"cannot serve HTTP on {host_port(host, port)}: {error}") from None


class HTTPServer:
    def __init__(self, app, host: str, port: int, tls: TLSConfig | None):
        self.socket = bind(host, port)
        self.port = self.socket.getsockname()[1]
        tls_options = (
            {}
            if tls is None
            else {
                "ssl_certfile": tls.cert,
                "ssl_keyfile": tls.key,
                "ssl_ca_certs": tls.client_ca,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.client_ca else ssl.CERT_NONE,
            }
        )
        # log_config None: uvicorn leaves the process's logging as serve.py set it up
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
            **tls_options,
        )
        self.server = uvicorn.Server(config)
        logging.getLogger("uvicorn.error").addFilter(EXPIRED_STREAMS)  # where uvicorn reports an app's exceptions
        self.thread = threading.Thread(target=self._run, name="jaxserve-http", daemon=True)
        self.failure: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        except BaseException as error:  # reported by start(); uvicorn exits with SystemExit on start-up failures
            self.failure = error

    def start(self) -> None:
        """Serve, or ValueError when uvicorn cannot (a TLS file it cannot load, for one)."""
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            self.stop()
            raise ValueError(f"the HTTP server did not start: {self.failure or 'timed out'}")

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.ident is not None:  # started
            self.thread.join(timeout=GRACEFUL_SHUTDOWN + 5)
        if self.thread.is_alive():
            logger.warning("the HTTP server did not stop in time")
        self.socket.close()
