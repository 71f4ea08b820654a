"""The life of a server process, shared by `jaxserve.serve` and `jaxserve.router`: log set-up, start
(a ValueError is a configuration problem: exit 2 with the reason), serve until SIGTERM or Ctrl-C, stop."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

ServerT = TypeVar("ServerT")


def run_until_signalled(program: str, start: Callable[[], ServerT], stop: Callable[[ServerT], None]) -> int:
    """start() builds and starts the server; stop(server) drains and stops it. Returns the exit code."""
    # force: libraries imported earlier (orbax, via absl) may have claimed the root logger already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())
    try:
        server = start()
    except ValueError as error:
        print(f"{program}: {error}", file=sys.stderr)
        return 2
    stop_requested.wait()
    stop(server)
    return 0
