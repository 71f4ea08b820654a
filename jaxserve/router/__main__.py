"""`python -m jaxserve.router --config configs/router.yaml [--set section.key=value ...]`: the router.

Serves the jaxserve gRPC API in front of the replicas the config lists or launches, sending each
request where its prefix is cached (router.policy); with router.mode disaggregated, to a prefill replica
and a decode replica, which hands the prompt's KV pages from one to the other. SIGTERM (or Ctrl-C) stops it, and the replicas
it launched.
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.router.config import load_router_config
from jaxserve.router.server import RouterServer
from jaxserve.server.process import run_until_signalled


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
        server.start()
        print(f"jaxserve.router: serving on {server.config.router.host}:{server.port}", flush=True)
        return server

    return run_until_signalled("jaxserve.router", start, RouterServer.stop)


if __name__ == "__main__":
    sys.exit(main())
