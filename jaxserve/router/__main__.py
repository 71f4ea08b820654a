"""`python -m jaxserve.router --config configs/router.yaml [--set section.key=value ...]`: the router.

Serves the jaxserve gRPC API in front of the replicas the config lists or launches, sending each
request where its prefix is cached (router.policy); with router.mode disaggregated, to a prefill replica
and a decode replica, which hands the prompt's KV pages from one to the other. SIGTERM (or Ctrl-C) drains:
new requests get UNAVAILABLE (HTTP 503), those in flight finish (up to router.drain_timeout); then it stops,
and the replicas it launched, with exit code 0: also while it still waits for them at start-up.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxserve.router.config import load_router_config
from jaxserve.router.server import RouterServer
from jaxserve.server.address import host_port
from jaxserve.server.process import StopRequested, run_until_signalled, signals_interrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxserve.router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the router's YAML config (see configs/router.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set router.policy=round_robin",
    )
    args = parser.parse_args(argv)

    def start() -> RouterServer:
        server = RouterServer(load_router_config(args.config, args.overrides))
        try:
            with signals_interrupt():
                server.start()  # interrupted, it has stopped what it started (launched replicas too)
        except StopRequested:
            logging.getLogger("jaxserve.router").info("stopped while starting")
            return server  # the stop is recorded: run_until_signalled stops it (again: harmless) and exits 0
        print(f"jaxserve.router: serving on {host_port(server.config.router.host, server.port)}", flush=True)
        return server

    def stop(server: object) -> None:
        assert isinstance(server, RouterServer)
        server.drain_and_stop()

    return run_until_signalled("jaxserve.router", start, stop)


if __name__ == "__main__":
    sys.exit(main())
