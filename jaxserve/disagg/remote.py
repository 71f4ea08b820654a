"""The decode side of a prefill worker in another process (prefill_worker.py): prompts go out, first
tokens and page keys come back over a loopback connection, the missing pages' bytes are pulled with
JAX's transfer server. If the worker dies or stops answering, every request still in its hands is
recomputed here: nothing is lost, and reserved pages are freed."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client

import jax
from jax.experimental import transfer

from jaxserve.disagg.handover import HandoverStats
from jaxserve.disagg.metadata import PrefilledRequest
from jaxserve.disagg.prefill_worker import AUTHKEY
from jaxserve.host.request import SamplingParams


def start_prefill_worker(model: str, engine_options: dict, timeout: float = 30.0, cpus=None,
                         startup_timeout: float = 300.0) -> tuple[subprocess.Popen, int]:
    """Launch a worker on a free loopback port (optionally pinned to cpus); returns it and its port."""
    process = subprocess.Popen([sys.executable, "-m", "jaxserve.disagg.prefill_worker", model, "0",
                                json.dumps(engine_options), str(timeout)], stdout=subprocess.PIPE, text=True,
                               preexec_fn=(lambda: __import__("os").sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise RuntimeError(f"prefill worker exited with {process.returncode}")
        if line.startswith("{"):
            return process, json.loads(line)["port"]
    process.kill()
    raise TimeoutError("prefill worker did not start in time")


class RemotePrefill:
    """Drives a decode engine fed by a prefill worker; step() returns the decode engine's outputs."""

    def __init__(self, decode_engine, port: int, reply_timeout: float = 30.0):
        self.engine = decode_engine
        self.reply_timeout = reply_timeout
        self.connection = Client(("127.0.0.1", port), authkey=AUTHKEY)
        hello = self.connection.recv()
        self.server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
        self.peer = self.server.connect(hello["transfer_address"])
        self.in_flight: dict[str, tuple[list[int], SamplingParams]] = {}
        self.finished_early: list = []  # the worker's messages for requests done at their first token
        self.backlog: list = []
        self.stats = HandoverStats()
        self.alive = True
        self._transfer_ids = itertools.count(1)
        self.last_heard = time.monotonic()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.in_flight[request_id] = (prompt_token_ids, params)
        self._send({"kind": "prefill", "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                    "params": dataclasses.asdict(params)})

    def _send(self, message: dict) -> None:
        try:
            self.connection.send(message)
        except (OSError, EOFError):
            self._lost()

    def _receive(self, timeout: float):
        try:
            if self.connection.poll(timeout):
                self.last_heard = time.monotonic()
                return self.connection.recv()
        except (OSError, EOFError):
            self._lost()
        return None

    def _lost(self) -> None:
        """The worker is gone: recompute here whatever it still held."""
        if not self.alive:
            return
        self.alive = False
        for request_id, (prompt, params) in self.in_flight.items():
            self.engine.handovers.recompute(request_id, prompt, params)
            self.stats.num_recomputed += 1
        self.in_flight.clear()

    def step(self) -> list:
        while self.alive and self.backlog:
            self._on_message(self.backlog.pop(0))
        while self.alive and (message := self._receive(0)) is not None:
            self._on_message(message)
        if self.alive and self.in_flight and time.monotonic() - self.last_heard > self.reply_timeout:
            self._lost()  # silent too long: treat as dead
        outputs, self.finished_early = self.finished_early + self.engine.step(), []
        return outputs

    def _on_message(self, message: dict) -> None:
        if message["kind"] == "finished":
            self.in_flight.pop(message["request_id"], None)
            self.finished_early.append(message)
        elif message["kind"] == "prefilled":
            message.pop("kind")
            self._hand_over(PrefilledRequest(**{**message, "params": SamplingParams(**message["params"])}))

    def _hand_over(self, prefilled: PrefilledRequest) -> None:
        request_id, handovers = prefilled.request_id, self.engine.handovers
        reservation = handovers.reserve(request_id, prefilled.prompt_token_ids, prefilled.params)
        if reservation is None:  # no room: free the worker's pages and run it here from scratch
            self._send({"kind": "release", "request_id": request_id})
            self.in_flight.pop(request_id)
            handovers.recompute(request_id, prefilled.prompt_token_ids, prefilled.params)
            self.stats.num_recomputed += 1
            return
        started, transfer_id = time.perf_counter(), next(self._transfer_ids)
        self._send({"kind": "send_pages", "request_id": request_id, "held_keys": reservation.held_keys,
                    "transfer_id": transfer_id})
        ready = self._await_pages_ready(request_id)
        data = self._pull(ready, transfer_id) if ready is not None else None
        if ready is None or (ready["num_pages"] and data is None):
            self._lost()  # recomputes this request too (its reservation is cancelled there)
            return
        if data is not None:
            self.engine.runner.scatter_pages(reservation.missing_page_ids,
                                             jax.device_put(data, self.engine.runner.page_array_sharding()))
            self.stats.bytes_moved += data.nbytes
        self._send({"kind": "release", "request_id": request_id})
        self.in_flight.pop(request_id)
        handovers.complete(prefilled)
        self.stats.seconds_moving += time.perf_counter() - started
        self.stats.num_handovers += 1
        self.stats.num_pages_moved += len(reservation.missing_page_ids)
        self.stats.num_pages_reused += len(reservation.held_keys)

    def _await_pages_ready(self, request_id: str) -> dict | None:
        """The worker's answer for this request; other requests' messages that come first wait their turn."""
        deadline = time.monotonic() + self.reply_timeout
        while self.alive and time.monotonic() < deadline:
            message = self._receive(0.1)
            if message is not None and message["kind"] == "pages_ready" and message["request_id"] == request_id:
                return message
            if message is not None:
                self.backlog.append(message)
        return None

    def _pull(self, ready: dict, transfer_id: int):
        """Pull in a thread so that a worker dying mid-pull costs a timeout, not a hang."""
        if not ready["num_pages"]:
            return None
        spec = jax.ShapeDtypeStruct(tuple(ready["shape"]), ready["dtype"],
                                    sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        result = []
        thread = threading.Thread(target=lambda: result.append(self.peer.pull(transfer_id, [spec])[0]), daemon=True)
        thread.start()
        thread.join(self.reply_timeout)
        return jax.block_until_ready(result[0]) if result else None

    def worker_stats(self) -> dict | None:
        self._send({"kind": "stats"})
        deadline = time.monotonic() + self.reply_timeout
        while self.alive and time.monotonic() < deadline:
            message = self._receive(0.1)
            if message is not None and message["kind"] == "stats":
                return message
            if message is not None:
                self.backlog.append(message)
        return None

    def close(self) -> None:
        self._send({"kind": "stop"})
        self.connection.close()
