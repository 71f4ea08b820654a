"""SubscribeKVEvents: the engine's page events (host/kv_events.py) as a gRPC stream, for routers.

A subscription starts with a snapshot (every cached page, as STORED events, numbered as of the log's
latest event), then sends the events after it in batches, each with the replica's load: whenever the
engine loop publishes (after each step) and at least every heartbeat, so that a silent replica is a
dead one. A subscriber that has fallen further behind than the log retains is sent a new snapshot.
No batch holds more than MAX_EVENTS_PER_BATCH events, so that a cache of a million pages is still a
stream of small messages: a snapshot continues over several batches (`more`), a long delta is split.

Subscriptions run on a pool of their own: each holds a thread for its whole life, and must take
neither the threads of Generate streams nor those of health checks.
"""

from __future__ import annotations

import threading
import uuid
from concurrent import futures

import grpc

from jaxserve.host.kv_events import DEVICE, REMOVED, STORED, KVEvent
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server.rpc import GENERATION_SERVICE, parse

INSTANCE_ID = uuid.uuid4().hex  # one per server process: a router sees a restart as a new id
MAX_SUBSCRIBERS = 8  # routers, not clients: a few each
DEFAULT_HEARTBEAT = 0.5  # seconds
MIN_HEARTBEAT = 0.05
MAX_EVENTS_PER_BATCH = 4096  # about 140 KB a message
KINDS = {STORED: pb.KVEvent.STORED, REMOVED: pb.KVEvent.REMOVED}


def event_to_proto(event: KVEvent) -> pb.KVEvent:
    return pb.KVEvent(
        kind=KINDS.get(event.kind, pb.KVEvent.CLEARED),
        key=event.key,
        parent_key=event.parent_key,
        num_tokens=event.num_tokens,
        tier=pb.KVEvent.DEVICE if event.tier == DEVICE else pb.KVEvent.HOST,
        rank=event.rank,
    )


def load_to_proto(stats: dict) -> pb.ReplicaLoad:
    """stats: the engine's stats() as the loop last took them."""
    return pb.ReplicaLoad(
        num_running=stats["num_running"],
        num_waiting=stats["num_waiting"],
        num_free_pages=stats["kv_pages_free"],
        num_tokens_waiting_prefill=stats["num_tokens_waiting_prefill"],
        prefill_seconds_per_token=stats["prefill_seconds_per_token"],
        swap_in_seconds_per_page=stats["swap_in_seconds_per_page"],
        step_seconds=stats["step_seconds"],
        lora_root_keys=stats.get("lora_root_keys", {}),
    )


class KVEventsService:
    def __init__(self, generation_service):
        self.generation = generation_service  # its loop is set once the engine has warmed up
        self._lock = threading.Lock()
        self.num_subscribers = 0

    def _snapshot(self, sequence: int, events: list[KVEvent], load):
        """The first batch replaces what the subscriber knows; the rest add to it, all at `sequence`."""
        chunks = [events[start : start + MAX_EVENTS_PER_BATCH] for start in range(0, len(events), MAX_EVENTS_PER_BATCH)]
        for index, chunk in enumerate(chunks or [[]]):
            yield self._batch(sequence, chunk, load, snapshot=index == 0, more=index < len(chunks) - 1)

    def _deltas(self, sequence: int, events: list[KVEvent], load):
        """Events numbered up to `sequence`, in batches each ending at the number of its last event."""
        first = sequence - len(events) + 1
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            chunk = events[start : start + MAX_EVENTS_PER_BATCH]
            yield self._batch(first + start + len(chunk) - 1, chunk, load)
        if not events:
            yield self._batch(sequence, [], load)  # a heartbeat, with the load

    def _batch(
        self, sequence: int, events: list[KVEvent], load, snapshot: bool = False, more: bool = False
    ) -> pb.KVEventBatch:
        stats = load if load is not None else self.generation.loop.stats
        return pb.KVEventBatch(
            sequence=sequence,
            snapshot=snapshot,
            events=[event_to_proto(e) for e in events],
            load=load_to_proto(stats),
            instance_id=INSTANCE_ID,
            more=more,
        )

    def SubscribeKVEvents(self, request: pb.SubscribeKVEventsRequest, context):
        if self.generation.loop is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still warming up")
        with self._lock:
            if self.num_subscribers >= MAX_SUBSCRIBERS:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_SUBSCRIBERS} KV event subscribers already; this is for routers",
                )
            self.num_subscribers += 1
        try:
            yield from self._stream(max(request.heartbeat_ms / 1000 or DEFAULT_HEARTBEAT, MIN_HEARTBEAT), context)
        finally:
            with self._lock:
                self.num_subscribers -= 1

    def _stream(self, heartbeat: float, context):
        log = self.generation.loop.engine.kv_events()
        version = log.wait(-1, 0)
        sequence, events, load = log.snapshot()
        yield from self._snapshot(sequence, events, load)
        while context.is_active():
            version = log.wait(version, heartbeat)
            after = log.events_after(sequence)
            if after is None:  # fell behind what the log retains
                sequence, events, load = log.snapshot()
                yield from self._snapshot(sequence, events, load)
                continue
            sequence, events, load = after
            yield from self._deltas(sequence, events, load)


def kv_events_handler(generation_service) -> tuple[grpc.GenericRpcHandler, futures.ThreadPoolExecutor]:
    """SubscribeKVEvents of the Generation service, beside the handler rpc.py makes for its other methods
    (gRPC asks each handler in turn), and the pool it runs on (to shut down with the server)."""
    service = KVEventsService(generation_service)
    pool = futures.ThreadPoolExecutor(max_workers=MAX_SUBSCRIBERS + 1, thread_name_prefix="jaxserve-kv-events")

    def handle(request_bytes, context):
        return service.SubscribeKVEvents(parse(pb.SubscribeKVEventsRequest, request_bytes, context), context)

    handle.experimental_thread_pool = pool
    method = grpc.unary_stream_rpc_method_handler(handle, response_serializer=pb.KVEventBatch.SerializeToString)
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, {"SubscribeKVEvents": method}), pool


def router_info(description, stats: dict) -> pb.ServerInfo:
    """ServerInfo's fields for routers (20-29), to merge into the rest."""
    return pb.ServerInfo(
        model_fingerprint=description.model_fingerprint,
        prefill_seconds_per_token=stats["prefill_seconds_per_token"],
        swap_in_seconds_per_page=stats["swap_in_seconds_per_page"],
        num_tokens_waiting_prefill=stats["num_tokens_waiting_prefill"],
        host_tier_pages=description.host_tier_pages,
        instance_id=INSTANCE_ID,
        step_seconds=stats["step_seconds"],
    )
