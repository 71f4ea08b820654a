"""The life of a server process, shared by `jaxserve.serve` and `jaxserve.router`: log set-up, start
(a ValueError is a configuration problem: exit 2 with the reason), serve until SIGTERM or Ctrl-C, stop.

A signal during start-up interrupts it where start() lets it (signals_interrupt: loading and warming up
the engine, waiting for replicas); a second signal, at any time, exits at once (code 128 + the signal's)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

ServerT = TypeVar("ServerT")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# process-wide, as signals are: set by the first SIGTERM or Ctrl-C that run_until_signalled's handler sees
_stop_requested = threading.Event()


class StopRequested(BaseException):
    """SIGTERM or Ctrl-C during start-up, raised where start-up runs inside signals_interrupt. A BaseException,
    as KeyboardInterrupt is: no `except Exception` swallows it."""


RETRY_INTERVAL = 0.5  # seconds between raises of StopRequested until one is not swallowed


def _handling_stop() -> bool:
    """Whether this thread is handling (or unwinding with) a StopRequested: start-up is cleaning up."""
    error = sys.exc_info()[1]
    while error is not None:
        if isinstance(error, StopRequested):
            return True
        error = error.__context__
    return False


@contextlib.contextmanager
def signals_interrupt():
    """While inside, SIGTERM and SIGINT raise StopRequested, after running the handlers installed before
    (run_until_signalled's, which records the stop: the process then stops what started and exits 0). A stop
    requested before entering raises at once. Whoever catches StopRequested must stop what it started (a
    start() that cleans up on any exception does).

    A signal handler's exception can be swallowed: raised inside a garbage-collection callback or a __del__
    (JAX has one, which runs often while it compiles), Python prints and drops it. So after a signal
    StopRequested is raised again every RETRY_INTERVAL seconds (SIGALRM) until start-up is seen handling it."""
    signums = (*SIGNALS, signal.SIGALRM)
    previous = {signum: signal.getsignal(signum) for signum in signums}
    requested = False

    def retry(signum, frame):
        if not _handling_stop():
            raise StopRequested

    def interrupt(signum, frame):
        nonlocal requested
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        if not requested:
            requested = True
            signal.signal(signal.SIGALRM, retry)
            signal.setitimer(signal.ITIMER_REAL, RETRY_INTERVAL, RETRY_INTERVAL)
            raise StopRequested

    for signum in SIGNALS:
        signal.signal(signum, interrupt)
    try:
        if _stop_requested.is_set():
            requested = True
            raise StopRequested
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _on_signal(signum, frame) -> None:
    if _stop_requested.is_set():  # a second signal: the orderly stop is taking too long for someone
        os.write(2, f"\n{signal.Signals(signum).name} again: exiting now\n".encode())
        os._exit(128 + signum)
    _stop_requested.set()


def run_until_signalled(program: str, start: Callable[[], ServerT], stop: Callable[[ServerT], None]) -> int:
    """start() builds and starts the server; stop(server) drains and stops it. Returns the exit code."""
    # force: libraries imported earlier (orbax, via absl) may have claimed the root logger already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    _stop_requested.clear()
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    try:
        server = start()
    except ValueError as error:
        print(f"{program}: {error}", file=sys.stderr)
        return 2
    _stop_requested.wait()
    stop(server)
    return 0
