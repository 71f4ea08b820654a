"""Hostile clients for bench/serving.py --hostile KIND: each kind runs in threads of a process of its
own (so that building and sending its requests does not slow the measuring client), one closed loop
per thread (resend as soon as the previous call ends), until stopped. They are the cases of issue
#18; the benchmark compares well-behaved clients' latency with and without them.

    big-prompts   4 clients sending 3.9 MB text prompts
    many-stops    1 client sending requests with 200k stop strings (about 2.5 MB)
    stop-ids      1 client sending requests with 1.5M stop token ids
    unread        4 x max_num_seqs streams that never read their responses, renewed as they end
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import grpc

from jaxserve.client import Client, Connection, build_request
from jaxserve.proto import jaxserve_pb2_grpc

KINDS = ("big-prompts", "many-stops", "stop-ids", "unread")
UNREAD_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def _requests(kind: str):
    if kind == "big-prompts":
        return build_request("word " * 780_000, max_tokens=32), 4
    if kind == "many-stops":
        return build_request(
            [1, 5, 9], max_tokens=64, ignore_eos=True, stop=[f"never-{i:06d}" for i in range(200_000)]
        ), 1
    if kind == "stop-ids":
        return build_request([1, 5, 9], max_tokens=64, ignore_eos=True, stop_token_ids=[2] * 1_500_000), 1
    raise ValueError(f"unknown hostile kind {kind!r}; expected one of {', '.join(KINDS)}")


def _loop(target: str, connection: Connection, request, stop, counts: dict) -> None:
    client = Client(target, connection)
    while not stop.is_set():
        try:
            for _ in client.stub.Generate(request, metadata=client.metadata, timeout=60):
                pass
            counts["accepted"] += 1
        except grpc.RpcError as error:
            counts[error.code().name] = counts.get(error.code().name, 0) + 1
    client.close()


def _unread_loop(target: str, connection: Connection, stop, counts: dict) -> None:
    """Opens a stream that is never read, and a new one whenever the server ends it."""
    request = build_request([1, 4, 4], max_tokens=200, ignore_eos=True, logprobs=5)
    while not stop.is_set():
        channel = (
            grpc.secure_channel(target, connection.credentials(), options=UNREAD_OPTIONS)
            if connection.uses_tls
            else grpc.insecure_channel(target, options=UNREAD_OPTIONS)
        )
        call = jaxserve_pb2_grpc.GenerationStub(channel).Generate(request, metadata=connection.metadata, timeout=60)
        counts["opened"] += 1
        while not stop.is_set() and not call.done():
            stop.wait(0.2)
        call.cancel()
        channel.close()


def _run(kind: str, target: str, connection: Connection, max_num_seqs: int, stop, results) -> None:
    """The hostile process: runs the clients until `stop` is set, then reports their outcomes. Its
    first message says the clients are running."""
    counts = {"accepted": 0, "opened": 0}
    if kind == "unread":
        threads = [
            threading.Thread(target=_unread_loop, args=(target, connection, stop, counts), daemon=True)
            for _ in range(4 * max_num_seqs)
        ]
    else:
        request, num_clients = _requests(kind)
        threads = [
            threading.Thread(target=_loop, args=(target, connection, request, stop, counts), daemon=True)
            for _ in range(num_clients)
        ]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the first hostile calls are in flight
    results.put("started")
    stop.wait()
    for thread in threads:
        thread.join(timeout=70)
    results.put(counts)


class HostileClients:
    def __init__(self, kind: str, target: str, connection: Connection, max_num_seqs: int):
        context = multiprocessing.get_context("spawn")
        self._stop, self._results = context.Event(), context.Queue()
        self._process = context.Process(
            target=_run, args=(kind, target, connection, max_num_seqs, self._stop, self._results), daemon=True
        )
        self._process.start()
        assert self._results.get(timeout=300) == "started"  # the measuring starts once they run

    def stop(self) -> dict:
        """Stops the clients; returns how their calls ended, by status."""
        self._stop.set()
        counts = self._results.get(timeout=120)
        self._process.join(timeout=10)
        return counts
