"""Page bytes between processes: each replica runs one JAX transfer server. The prefill side offers a
handover's chunks under a transfer id (await_pull); the decode side connects to the prefill side's
server once per address and pulls them. A pull that does not finish in time (the prefill process died
mid-transfer) is abandoned: its thread may stay blocked, the caller recomputes the prompt."""

from __future__ import annotations

import itertools
import threading

import jax
from jax.experimental import transfer

from jaxserve.proto import disagg_pb2 as dpb


class PageTransfers:
    def __init__(self, host: str = "127.0.0.1"):
        device = jax.devices()[0]
        self.device = device
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._connections: dict[str, transfer.TransferConnection] = {}
        self._lock = threading.Lock()
        self._transfer_ids = itertools.count(1)  # unique per server: every puller of this replica shares it

    def offer(self, chunks: list[jax.Array]) -> tuple[int, list[dpb.PageChunk]]:
        """Let one client pull the chunks (moved onto one device first); returns the transfer id."""
        chunks = [jax.device_put(chunk, self.device) for chunk in chunks]
        transfer_id = next(self._transfer_ids)
        if chunks:
            self.server.await_pull(transfer_id, chunks)
        return transfer_id, [dpb.PageChunk(shape=list(chunk.shape), dtype=str(chunk.dtype)) for chunk in chunks]

    def pull(self, address: str, transfer_id: int, chunks, timeout: float) -> list[jax.Array] | None:
        """The offered chunks on this process's first device, or None after timeout seconds."""
        if not chunks:
            return []
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(tuple(chunk.shape), chunk.dtype, sharding=sharding) for chunk in chunks]
        result: list = []

        def run():
            arrays = self._connection(address).pull(transfer_id, specs)
            result.append(jax.block_until_ready(arrays))

        thread = threading.Thread(target=run, name=f"pull-{transfer_id}", daemon=True)
        thread.start()
        thread.join(timeout)
        return list(result[0]) if result else None

    def _connection(self, address: str):
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self.server.connect(address)
            return self._connections[address]
