"""A prefill replica in its own process: `python -m jaxserve.disagg.prefill_worker MODEL PORT ENGINE_JSON`.

It takes prompts from one decode client over a loopback connection (multiprocessing.connection, the
metadata), runs each to its first token, and on request offers the pages the client lacks through
JAX's transfer server (the bytes); parked pages are freed when the client releases them or when the
handover times out (a vanished client leaks nothing here).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from multiprocessing.connection import Listener

import jax
from jax.experimental import transfer

from jaxserve import LLM, SamplingParams
from jaxserve.disagg.metadata import PrefilledRequest

AUTHKEY = b"jaxserve-disagg"  # loopback only; guards against a stray client, not an attacker


def offer_pages(engine, server, request_id: str, held_keys, transfer_id: int) -> dict:
    """Gather the pages the client lacks onto one device and let the client pull them once."""
    pages = engine.handovers.pages_to_send(request_id, held_keys)
    if not pages:
        return {"shape": None, "num_pages": 0}
    data = jax.device_put(engine.runner.gather_pages(pages), jax.devices()[0])
    server.await_pull(transfer_id, [data])
    return {"shape": list(data.shape), "dtype": str(data.dtype), "num_pages": len(pages)}


def handle(message: dict, engine, server, connection) -> bool:
    kind = message["kind"]
    if kind == "prefill":
        engine.add_request(message["request_id"], message["prompt_token_ids"],
                           SamplingParams(**message["params"]))
    elif kind == "send_pages":
        offered = offer_pages(engine, server, message["request_id"], message["held_keys"], message["transfer_id"])
        connection.send({"kind": "pages_ready", "request_id": message["request_id"], **offered})
    elif kind == "release":
        engine.handovers.release(message["request_id"])
    elif kind == "stats":
        stats = engine.stats()
        connection.send({"kind": "stats", "pages_free": stats["kv_pages_free"], "pages_total": stats["kv_pages_total"],
                         "parked": len(engine.handovers.parked), "expired": engine.handovers.num_expired})
    elif kind == "stop":
        return False
    return True


def report_steps(engine, connection) -> None:
    for output in engine.step():
        if output.finished:
            connection.send({"kind": "finished", "request_id": output.request_id,
                             "token_ids": output.outputs[0].token_ids})
        elif output.request_id in engine.handovers.parked:
            prefilled = dataclasses.asdict(engine.handovers.prefilled(output.request_id))
            connection.send({"kind": "prefilled", **prefilled})
    engine.handovers.expire()


def serve(model: str, port: int, engine_options: dict, timeout: float) -> None:
    engine = LLM(model, role="prefill", **engine_options).engine
    engine.handovers.timeout = timeout
    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    with Listener(("127.0.0.1", port), authkey=AUTHKEY) as listener:
        print(json.dumps({"ready": True, "port": listener.address[1]}), flush=True)
        with listener.accept() as connection:
            connection.send({"kind": "hello", "transfer_address": server.address()})
            running = True
            while running:
                busy = engine.has_unfinished_requests()
                try:
                    while running and connection.poll(0 if busy else 0.05):
                        running = handle(connection.recv(), engine, server, connection)
                    if busy:
                        report_steps(engine, connection)
                except (EOFError, OSError):
                    return  # the client is gone; the process and its pages go with it
                engine.handovers.expire()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 30.0)
