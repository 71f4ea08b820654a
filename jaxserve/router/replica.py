"""One replica as the router knows it: its channel, its cache (from its own page events), its load, and
whether requests may go there.

Two threads per replica. The follower checks the replica's ServerInfo (the same model as the router's),
subscribes to its page events and applies them; a snapshot makes the replica routable, a gap or a broken
stream starts over with a fresh subscription. The watchdog checks health and that batches keep coming (at
least one per heartbeat); a failure takes the replica out and cancels the subscription, so that it comes
back only from a fresh snapshot. A request that fails there reports it too (`report_failure`).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import Connection
from jaxserve.host.kv_events import CLEARED, DEVICE, HOST, REMOVED, STORED, KVEvent
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.router.cache_view import CacheView
from jaxserve.router.connection import PLAIN, replica_channel

logger = logging.getLogger("jaxserve.router")

KINDS = {pb.KVEvent.STORED: STORED, pb.KVEvent.REMOVED: REMOVED, pb.KVEvent.CLEARED: CLEARED}
MISSED_HEARTBEATS = 10  # batches missing for this many heartbeats: the replica is hung
FAILED_HEALTH_CHECKS = 2  # in a row: taken out (one may be a busy machine)
HEALTH_TIMEOUT = 2.0  # seconds, at least
MAX_BACKOFF = 2.0  # seconds between attempts to reach a replica that is down
INFO_TIMEOUT = 5.0
MAX_RECEIVE_BYTES = 64 * 2**20  # event batches are bounded far below this; ServerInfo lists the compiled buckets


def event_from_proto(event: pb.KVEvent) -> KVEvent:
    return KVEvent(
        KINDS[event.kind],
        event.key,
        event.parent_key,
        event.num_tokens,
        HOST if event.tier == pb.KVEvent.HOST else DEVICE,
        event.rank,
    )


class ModelMismatch(ValueError):
    """The replica serves another model than the router's."""


def check_info(address: str, info: pb.ServerInfo, model_fingerprint: str) -> None:
    if info.model_fingerprint != model_fingerprint:
        raise ModelMismatch(
            f"replica {address} serves model {info.model!r} (fingerprint {info.model_fingerprint}), "
            f"not the router's model (fingerprint {model_fingerprint}): check model.path in both "
            f"configs"
        )


class Replica:
    def __init__(
        self,
        address: str,
        model_fingerprint: str,
        blind_window: float,
        heartbeat: float,
        health_interval: float,
        metrics=None,
        connection: Connection = PLAIN,
    ):
        self.address = address
        self.model_fingerprint = model_fingerprint
        self.heartbeat = heartbeat
        self.health_interval = health_interval
        self.metrics = metrics
        self.channel = replica_channel(address, connection, [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
        self.stub = jaxserve_pb2_grpc.GenerationStub(self.channel)
        self.view = CacheView(blind_window)
        self.info: pb.ServerInfo | None = None
        self.load = pb.ReplicaLoad()
        self.instance_id = ""
        self.down_reason = "not subscribed yet"
        self.num_snapshots = 0
        self._subscribed = False  # a snapshot has arrived on the current subscription
        self._healthy = False
        self._last_batch_at = 0.0
        self._call = None
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()
        self.num_outstanding = 0  # requests routed here that have not streamed a token yet
        self._calls: set = set()  # forwarded calls in progress, to cancel when the replica is taken out
        self.outstanding_prefill_tokens = 0  # their uncached tokens
        self.outstanding_pages = 0  # the free pages their admission will take
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=target, name=f"router-{name}-{address}", daemon=True)
            for name, target in (("follow", self._follow_forever), ("watch", self._watch_forever))
        ]

    @property
    def is_up(self) -> bool:
        return self._subscribed and self._healthy and not self._stopped.is_set()

    @property
    def page_size(self) -> int:
        """Routable replicas only: their ServerInfo has arrived."""
        if self.info is None:
            raise RuntimeError(f"replica {self.address}: no ServerInfo yet")
        return self.info.page_size

    @property
    def max_num_seqs(self) -> int:
        """Sequences the replica runs at once (0 before its ServerInfo has arrived: unknown)."""
        return self.info.max_num_seqs if self.info is not None else 0

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._cancel_subscription()
        for thread in self._threads:
            thread.join(timeout=5)
        self.channel.close()

    # -- routing bookkeeping (request threads) ----------------------------------------------------

    def routed(self, call, prediction) -> None:
        """A forwarded call (a grpc future) waiting for its first message: its prefill is queued here, and
        the pages it will take are not yet in the replica's count of free pages."""
        with self._lock:
            self._calls.add(call)
            self.num_outstanding += 1
            self.outstanding_prefill_tokens += prediction.num_uncached_tokens
            self.outstanding_pages += prediction.num_pages_needed

    def started(self, call, prediction) -> None:
        """Its first message arrived, or it failed, or was cancelled: its prefill is no longer queued."""
        with self._lock:
            self.num_outstanding -= 1
            self.outstanding_prefill_tokens -= prediction.num_uncached_tokens
            self.outstanding_pages -= prediction.num_pages_needed

    def finished(self, call) -> None:
        with self._lock:
            self._calls.discard(call)

    def report_failure(self, reason: str) -> None:
        self._take_out(reason, cancel_calls=True)

    # -- following the replica's events -----------------------------------------------------------

    def _set_up_state(self, subscribed: bool | None = None, healthy: bool | None = None) -> None:
        with self._state_lock:  # the follower and the watchdog both change it
            was_up = self.is_up
            if subscribed is not None:
                self._subscribed = subscribed
            if healthy is not None:
                self._healthy = healthy
            changed = was_up != self.is_up
        if changed:
            logger.info("replica %s is %s", self.address, "up" if self.is_up else f"down: {self.down_reason}")
            if self.metrics is not None:
                self.metrics.replica_up.labels(self.address).set(int(self.is_up))

    def _take_out(self, reason: str, cancel_calls: bool = False) -> None:
        """Out until a fresh snapshot. cancel_calls: the replica is dead or hung, so its calls are cancelled
        (those not yet streaming are re-sent elsewhere); a draining one finishes them itself."""
        self.down_reason = reason
        self._set_up_state(subscribed=False)
        self._cancel_subscription()
        if cancel_calls:
            with self._lock:
                calls = list(self._calls)
            for call in calls:
                call.cancel()

    def _cancel_subscription(self) -> None:
        call = self._call
        if call is not None:
            call.cancel()

    def _follow_forever(self) -> None:
        backoff = 0.05
        while not self._stopped.is_set():
            try:
                self.info = info = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=INFO_TIMEOUT)
                check_info(self.address, info, self.model_fingerprint)
                self._follow()
                backoff = 0.05
            except ModelMismatch as error:
                self._take_out(str(error))
                logger.error("%s", error)
                backoff = MAX_BACKOFF
            except grpc.RpcError as error:
                # CANCELLED: by this router (a gap, a take-out, stop); anything wrong shows up on the next try
                if not self._stopped.is_set() and error.code() != grpc.StatusCode.CANCELLED:
                    self._take_out(f"{error.code().name}: {error.details()}", cancel_calls=True)
            self._stopped.wait(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF)

    def _follow(self) -> None:
        """Until the stream breaks or has a gap."""
        request = pb.SubscribeKVEventsRequest(heartbeat_ms=int(self.heartbeat * 1000))
        self._call = self.stub.SubscribeKVEvents(request)
        if self._stopped.is_set():
            self._call.cancel()
        snapshot: list[KVEvent] | None = None  # a snapshot's events while more of them are coming
        for batch in self._call:
            self._last_batch_at = time.monotonic()
            events = [event_from_proto(event) for event in batch.events]
            if batch.snapshot or snapshot is not None:
                snapshot = events if batch.snapshot or snapshot is None else snapshot + events
                if batch.more:
                    continue
                self.view.reset(batch.sequence, snapshot)
                snapshot = None
                self.num_snapshots += 1
                self.instance_id = batch.instance_id
                self.load = batch.load  # before it is routable: routed on an empty load it would look idle
                self._set_up_state(subscribed=True)
            elif not self.view.apply(batch.sequence, events):
                logger.warning(
                    "replica %s: gap in page events after %s; resubscribing", self.address, self.view.sequence
                )
                self._count("resubscribes")
                self._last_batch_at = time.monotonic()  # the silence clock restarts with the new subscription
                self._call.cancel()
                return
            else:
                self._count_events(events)
            self.load = batch.load

    def _count_events(self, events: list[KVEvent]) -> None:
        if self.metrics is not None:
            for event in events:
                self.metrics.page_events.labels(self.address, event.kind, event.tier).inc()

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).labels(self.address).inc()

    # -- health -----------------------------------------------------------------------------------

    def _watch_forever(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        num_failed_checks = 0
        while not self._stopped.is_set():
            status = self._health_status(health)
            num_failed_checks = num_failed_checks + 1 if status is None else 0
            silent = time.monotonic() - self._last_batch_at
            if self._subscribed and silent > MISSED_HEARTBEATS * self.heartbeat:
                self._take_out(f"no page events for {silent:.1f}s (hung?)", cancel_calls=True)
            elif num_failed_checks >= FAILED_HEALTH_CHECKS:
                self._take_out(f"{num_failed_checks} health checks failed", cancel_calls=True)
                self._set_up_state(healthy=False)
            elif status is not None and status != health_pb2.HealthCheckResponse.SERVING:
                self.down_reason = f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
                self._set_up_state(healthy=False)  # draining: it finishes what it has, takes nothing new
            elif status is not None:
                self._set_up_state(healthy=True)
            self._stopped.wait(self.health_interval)

    def _health_status(self, health):
        """The replica's health status, or None when it does not answer in time."""
        request = health_pb2.HealthCheckRequest(service="jaxserve.v1.Generation")
        try:
            return health.Check(request, timeout=max(2 * self.health_interval, HEALTH_TIMEOUT)).status
        except grpc.RpcError:
            return None
