"""Which replica a request goes to.

`prefix` predicts each replica's time to first token: the wait for the step under way and for the prefill
already queued there, plus this request's own cost, where a page cached on the device costs nothing, a page
in the host tier costs a swap-in, and a missing page costs its tokens' prefill at the replica's measured rate
(in whole steps: see prefill_seconds). A replica that has not measured yet (right after start-up) is
predicted with its peers' slowest measurements, never as free. To the prediction it adds what the request's
decode loses to the sequences already there (sharing_seconds): without it, a replica holding a shared system
prompt wins every new conversation while the others idle. A replica without free pages for the request, or
without a free sequence slot (either way it would wait for running sequences to finish, which no rate
predicts), is chosen only when none has them. Costs less than a step apart (the replicas' median step time,
or TIE_TOLERANCE of the best) are ties, since a prediction counts whole steps of a noisy measured length:
among them the replica with the most of the prompt cached keeps it (its next turn will find the pages there
too), then the least loaded; a cold prefix (no hits anywhere) is therefore routed by load.

`round_robin`, `least_load` and `session` (sticky by session id, rendezvous hashing so that a replica going
away moves only its own sessions) are there to compare against.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from jaxserve.host.page_allocator import ROOT_KEY
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.cache_view import CacheView, PrefixMatch, prefix_keys

TIE_TOLERANCE = 0.05  # relative: predictions this close are ties
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 1e-4  # until some replica has measured its own
SWAP_IN_FRACTION = 0.1  # an unmeasured swap-in, as a fraction of recomputing the page


class RoutableReplica(Protocol):
    """What the policies read of a replica: router/replica.py's Replica, or a test's stand-in."""

    address: str
    load: pb.ReplicaLoad  # as the replica last reported it
    view: CacheView  # its cached pages, mirrored from its page events
    num_outstanding: int  # requests routed there that have not streamed a token yet
    outstanding_prefill_tokens: int  # their uncached prompt tokens
    outstanding_pages: int  # the free pages their admission will take

    @property
    def page_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...


ReplicaT = TypeVar("ReplicaT", bound=RoutableReplica)  # a prediction hands back the caller's own replica type


@dataclass
class RouteRequest:
    """What the policy sees of a request; page keys are computed once per page size."""

    token_ids: list[int]
    session_id: str = ""
    max_new_tokens: int = 16  # what the request may grow by: the pages it needs
    lora: str = ""  # the LoRA adapter it names (empty: the base model): its pages chain from the adapter's root
    _keys: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def keys(self, page_size: int, root_key: int = ROOT_KEY) -> list[int]:
        if (page_size, root_key) not in self._keys:
            self._keys[page_size, root_key] = prefix_keys(self.token_ids, page_size, root_key)
        return self._keys[page_size, root_key]


def replica_keys(replica: RoutableReplica, request: RouteRequest) -> list[int]:
    """The request's page keys as `replica`'s cache chains them: from the base root, or for a LoRA request from
    the adapter's identity as the replica reports it (ReplicaLoad.lora_root_keys, the same on every replica
    that loaded the same files); none where the replica has not reported the adapter (nothing there can hit)."""
    if not request.lora:
        return request.keys(replica.page_size)
    root_key = replica.load.lora_root_keys.get(request.lora)
    return [] if root_key is None else request.keys(replica.page_size, root_key)


def with_adapter(request: RouteRequest, replicas: list[ReplicaT]) -> list[ReplicaT]:
    """The replicas that can serve the request's LoRA adapter: those reporting it (ReplicaLoad.lora_root_keys; an
    adapter loaded at run time on some replicas only, or lost by a restart); all of them for a base-model request
    or an adapter none reports (a replica then refuses the unknown name with its reason)."""
    if not request.lora:
        return replicas
    return [r for r in replicas if request.lora in r.load.lora_root_keys] or replicas


@dataclass(frozen=True)
class Prediction(Generic[ReplicaT]):
    replica: ReplicaT
    match: PrefixMatch
    num_hit_tokens: int
    num_uncached_tokens: int
    ttft: float  # seconds
    cost: float  # seconds: ttft plus sharing_seconds, what the prefix policy minimizes
    load: int
    num_pages_needed: int  # free pages its admission takes, beyond its cached device pages
    fits: bool  # the replica has them, after what the router has sent there already


def replica_load(replica: RoutableReplica) -> int:
    """Sequences there, as the replica last said plus what the router has sent since."""
    return replica.num_outstanding + replica.load.num_running + replica.load.num_waiting


def prefill_rate(replica: RoutableReplica, replicas: Sequence[RoutableReplica]) -> float:
    """The replica's measured seconds per prefill token; before it has measured, its peers' slowest."""
    if replica.load.prefill_seconds_per_token > 0:
        return replica.load.prefill_seconds_per_token
    measured = [r.load.prefill_seconds_per_token for r in replicas if r.load.prefill_seconds_per_token > 0]
    return max(measured, default=DEFAULT_PREFILL_SECONDS_PER_TOKEN)


def step_time(replica: RoutableReplica, replicas: Sequence[RoutableReplica]) -> float:
    """The replica's measured step time; before it has measured (right after start-up), its peers' slowest.
    Never zero while any replica has measured: an unmeasured replica would otherwise be predicted without
    the step under way and without whole steps, and beat the replica that holds the prompt."""
    if replica.load.step_seconds > 0:
        return replica.load.step_seconds
    return max((r.load.step_seconds for r in replicas), default=0.0)


def has_free_slot(replica: RoutableReplica) -> bool:
    """Whether the replica can admit another sequence at once: at max_num_seqs a new request waits for a
    running one to finish, which no rate predicts. Unknown max_num_seqs (0): assumed free."""
    return not replica.max_num_seqs or replica_load(replica) < replica.max_num_seqs


def queued_prefill_tokens(replica: RoutableReplica) -> int:
    """The queue ahead of a new request: the uncached tokens of the requests the router sent there that have
    not streamed a token yet. The replica's own count (num_tokens_waiting_prefill) includes the cached
    prefixes its waiting requests will find, so it overstates; it stands in only while the router has
    nothing outstanding there (traffic from other clients, or a report not yet caught up)."""
    if replica.num_outstanding > 0:
        return replica.outstanding_prefill_tokens
    return replica.load.num_tokens_waiting_prefill


def prefill_seconds(step_seconds: float, num_tokens: int, per_token: float) -> float:
    """Half the step under way, then whole steps: chunked prefill computes a step's room of prompt tokens
    (step_seconds / per_token) per step, and a partial chunk still takes a whole step."""
    if step_seconds <= 0:  # not measured yet
        return num_tokens * per_token
    return step_seconds * (0.5 + max(1, math.ceil(num_tokens * per_token / step_seconds - 1e-9)))


def sharing_seconds(replica: RoutableReplica, request: RouteRequest, replicas: Sequence[RoutableReplica]) -> float:
    """What the request's decode loses to the sequences already on the replica: each takes one token of
    every step's budget (priced as the prompt token it displaces) for each token the request generates."""
    return replica_load(replica) * request.max_new_tokens * prefill_rate(replica, replicas)


def predict(replica: ReplicaT, request: RouteRequest, replicas: list[ReplicaT]) -> Prediction[ReplicaT]:
    page_size = replica.page_size
    match = replica.view.match(replica_keys(replica, request))
    num_hit_tokens = match.num_pages * page_size
    num_uncached = len(request.token_ids) - num_hit_tokens
    per_token = prefill_rate(replica, replicas)
    swap_in = replica.load.swap_in_seconds_per_page or SWAP_IN_FRACTION * per_token * page_size
    queued_tokens = queued_prefill_tokens(replica)
    ttft = (
        prefill_seconds(step_time(replica, replicas), queued_tokens + num_uncached, per_token)
        + match.num_host_pages * swap_in
    )
    num_pages = math.ceil((len(request.token_ids) + request.max_new_tokens) / page_size)
    num_pages_needed = num_pages - match.num_device_pages - match.num_pending_pages
    fits = num_pages_needed <= replica.load.num_free_pages - replica.outstanding_pages
    cost = ttft + sharing_seconds(replica, request, replicas)
    return Prediction(
        replica, match, num_hit_tokens, num_uncached, ttft, cost, replica_load(replica), num_pages_needed, fits
    )


class PrefixPolicy:
    name = "prefix"

    def choose(self, request: RouteRequest, replicas: list[ReplicaT]) -> Prediction[ReplicaT]:
        predictions = [predict(replica, request, replicas) for replica in replicas]
        fitting = [p for p in predictions if p.fits] or predictions
        predictions = [p for p in fitting if has_free_slot(p.replica)] or fitting
        best = min(p.cost for p in predictions)
        step = statistics.median(step_time(p.replica, replicas) for p in predictions)
        ties = [p for p in predictions if p.cost <= best + max(best * TIE_TOLERANCE, step) + 1e-9]
        return min(ties, key=lambda p: (-p.num_hit_tokens, p.load, p.cost))


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def choose(self, request: RouteRequest, replicas: list[ReplicaT]) -> Prediction[ReplicaT]:
        with self._lock:
            index = next(self._counter)
        return predict(replicas[index % len(replicas)], request, replicas)


class LeastLoadPolicy:
    name = "least_load"

    def choose(self, request: RouteRequest, replicas: list[ReplicaT]) -> Prediction[ReplicaT]:
        return predict(min(replicas, key=lambda r: (replica_load(r), r.outstanding_prefill_tokens)), request, replicas)


class SessionPolicy:
    """Sticky by session id; requests without one go by load."""

    name = "session"

    def choose(self, request: RouteRequest, replicas: list[ReplicaT]) -> Prediction[ReplicaT]:
        if not request.session_id:
            return LeastLoadPolicy().choose(request, replicas)

        def weight(replica: RoutableReplica) -> bytes:
            return hashlib.blake2b(f"{request.session_id}@{replica.address}".encode(), digest_size=8).digest()

        return predict(max(replicas, key=weight), request, replicas)


POLICIES = {cls.name: cls for cls in (PrefixPolicy, RoundRobinPolicy, LeastLoadPolicy, SessionPolicy)}
