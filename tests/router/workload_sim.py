"""A multi-turn chat workload over simulated replicas, for the routing policies' tests: no servers, no threads.

Each replica batches continuously on a simulated clock: a step decodes one token for each running sequence
and fills the rest of its token budget with prompt chunks, first come first served; its time grows with the
tokens it computes, as on an accelerator. It reports what a real replica's page events and load say: STORED
pages once a prompt (and later its answer) is computed, and running / waiting / queued prompt tokens and
measured step times (moving averages, as engine/stats.py measures them) after every step. The router's side
is RouterService's bookkeeping: the blind window, and the outstanding counts until a request's first token.

Users hold conversations that all start with one shared system prompt; each turn resends the conversation so
far plus a new message, after a think time, once the previous answer is complete.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from jaxserve.host.kv_events import DEVICE, STORED, KVEvent
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.cache_view import CacheView, prefix_keys
from jaxserve.router.policy import RouteRequest

PAGE_SIZE = 16
TOKEN_BUDGET = 64  # tokens a step computes at most (max_num_batched_tokens)
STEP_OVERHEAD = 0.005  # seconds a step takes however few tokens it computes
SECONDS_PER_TOKEN = 0.00025  # what each computed token adds to a step
AVERAGE_WEIGHT = 0.2  # of the newest measurement, as engine/stats.StepTimings


@dataclass
class SimRequest:
    conversation: int
    token_ids: list[int]
    num_new_tokens: int
    sent_at: float
    prediction: object = None
    num_cached_tokens: int = 0
    remaining_prefill: int = 0
    num_decoded: int = 0
    first_token_at: float | None = None
    output: list[int] = field(default_factory=list)
    next_messages: list[list[int]] = field(default_factory=list)  # what the user sends after this answer


class SimReplica:
    """What the policies read of a replica (router.replica.Replica's attributes), driven by the simulation."""

    def __init__(self, address: str, clock, max_num_seqs: int = 8):
        self.address, self.page_size, self.is_up = address, PAGE_SIZE, True
        self.view = CacheView(blind_window=2.0, clock=clock)
        self.view.reset(0, [])
        self.load = pb.ReplicaLoad(num_free_pages=100_000)
        self.num_outstanding = self.outstanding_prefill_tokens = self.outstanding_pages = 0
        self.max_num_seqs = max_num_seqs
        self.stored: set[int] = set()
        self.num_events = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy = False

    def store(self, token_ids: list[int]) -> None:
        """The full pages of token_ids are cached now: STORED events, applied as the router would."""
        keys = prefix_keys(token_ids + [0], PAGE_SIZE)  # every full page (prefix_keys skips the last token)
        events = [
            KVEvent(STORED, key, parent, PAGE_SIZE, DEVICE)
            for key, parent in zip(keys, [0] + keys[:-1])
            if key not in self.stored
        ]
        self.stored.update(keys)
        self.num_events += len(events)
        assert self.view.apply(self.num_events, events)

    def admit(self, request: SimRequest) -> None:
        """The replica's scheduler finds the cached prefix when the request gets a slot."""
        keys = prefix_keys(request.token_ids, PAGE_SIZE)
        num_hits = next((i for i, key in enumerate(keys) if key not in self.stored), len(keys))
        request.num_cached_tokens = num_hits * PAGE_SIZE
        request.remaining_prefill = len(request.token_ids) - request.num_cached_tokens
        self.running.append(request)

    def compose_step(self) -> tuple[float, list[SimRequest]]:
        """One step's work (mutating the requests' progress) and its duration; the requests it advanced."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.admit(self.waiting.popleft())
        decoding = [r for r in self.running if r.remaining_prefill == 0]
        room = TOKEN_BUDGET - len(decoding)
        num_tokens, advanced = len(decoding), list(decoding)
        for request in self.running:
            if request.remaining_prefill > 0 and room > 0:
                chunk = min(request.remaining_prefill, room)
                request.remaining_prefill -= chunk
                room -= chunk
                num_tokens += chunk
                if request.remaining_prefill == 0:
                    advanced.append(request)  # its last chunk: the step samples its first token
        seconds = STEP_OVERHEAD + SECONDS_PER_TOKEN * num_tokens
        self.measure(seconds, TOKEN_BUDGET - len(decoding))
        return seconds, advanced

    def measure(self, seconds: float, num_prefill_room: int) -> None:
        def average(old: float, new: float) -> float:
            return new if old == 0.0 else (1 - AVERAGE_WEIGHT) * old + AVERAGE_WEIGHT * new

        self.load.step_seconds = average(self.load.step_seconds, seconds)
        self.load.prefill_seconds_per_token = average(self.load.prefill_seconds_per_token, seconds / num_prefill_room)

    def report(self) -> None:
        self.load.num_running = len(self.running)
        self.load.num_waiting = len(self.waiting)
        self.load.num_tokens_waiting_prefill = sum(r.remaining_prefill for r in self.running) + sum(
            len(r.token_ids) for r in self.waiting
        )


class Workload:
    """Runs `policy` over `replicas` for the conversations; afterwards `requests` holds every turn served."""

    def __init__(self, policy, num_replicas: int = 3, seed: int = 0, max_num_seqs: int = 8):
        self.now = 0.0
        self.policy = policy
        self.replicas = [SimReplica(name, lambda: self.now, max_num_seqs) for name in "abcdefgh"[:num_replicas]]
        self.rng = random.Random(seed)
        self.requests: list[SimRequest] = []
        self.served_by: dict[int, list[str]] = {}  # conversation -> the replica of each turn
        self._events: list = []
        self._order = itertools.count()
        self.think_time = 0.2

    def at(self, time: float, action, *args) -> None:
        heapq.heappush(self._events, (time, next(self._order), action, args))

    def run(
        self,
        num_conversations: int = 12,
        num_turns: int = 6,
        system_tokens: int = 256,
        message_tokens: int = 24,
        answer_tokens: int = 32,
        think_time: float = 0.2,
        arrival_spread: float = 0.2,
    ) -> None:
        """Conversations start at random times within arrival_spread seconds."""
        self.think_time = think_time
        system = [1] + [self.rng.randrange(3, 30000) for _ in range(system_tokens - 1)]
        for conversation in range(num_conversations):
            messages = [[self.rng.randrange(3, 30000) for _ in range(message_tokens)] for _ in range(num_turns)]
            self.at(self.rng.uniform(0, arrival_spread), self.send, conversation, list(system), messages, answer_tokens)
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)

    def send(self, conversation: int, history: list[int], messages: list[list[int]], answer_tokens: int) -> None:
        request = SimRequest(conversation, history + messages[0], answer_tokens, self.now)
        route = RouteRequest(request.token_ids, f"conversation-{conversation}", answer_tokens)
        prediction = self.policy.choose(route, [r for r in self.replicas if r.is_up])
        replica = prediction.replica
        replica.view.note_routed(route.keys(PAGE_SIZE))
        replica.num_outstanding += 1
        replica.outstanding_prefill_tokens += prediction.num_uncached_tokens
        replica.outstanding_pages += prediction.num_pages_needed
        request.prediction = prediction
        request.output = [self.rng.randrange(3, 30000) for _ in range(answer_tokens)]
        self.requests.append(request)
        self.served_by.setdefault(conversation, []).append(replica.address)
        replica.waiting.append(request)
        request.next_messages = messages[1:]
        if not replica.busy:
            replica.busy = True
            self.at(self.now, self.step, replica)

    def step(self, replica: SimReplica) -> None:
        if not replica.running and not replica.waiting:
            replica.busy = False
            return
        seconds, advanced = replica.compose_step()
        self.at(self.now + seconds, self.end_step, replica, advanced)

    def end_step(self, replica: SimReplica, advanced: list[SimRequest]) -> None:
        for request in advanced:
            request.num_decoded += 1
            if request.first_token_at is None:
                request.first_token_at = self.now
                replica.store(request.token_ids)
                prediction = request.prediction
                replica.num_outstanding -= 1
                replica.outstanding_prefill_tokens -= prediction.num_uncached_tokens
                replica.outstanding_pages -= prediction.num_pages_needed
            if request.num_decoded == request.num_new_tokens:
                replica.running.remove(request)
                history = request.token_ids + request.output
                replica.store(history)
                if request.next_messages:
                    think = self.rng.expovariate(1 / self.think_time)
                    self.at(
                        self.now + think,
                        self.send,
                        request.conversation,
                        history,
                        request.next_messages,
                        len(request.output),
                    )
        replica.report()
        self.step(replica)

    # -- what the tests look at -----------------------------------------------------------------------

    def requests_per_replica(self) -> Counter:
        return Counter(r.prediction.replica.address for r in self.requests)

    def hit_rate(self) -> float:
        return sum(r.num_cached_tokens for r in self.requests) / sum(len(r.token_ids) for r in self.requests)

    def mean_ttft(self) -> float:
        return sum(r.first_token_at - r.sent_at for r in self.requests) / len(self.requests)

    def num_moves(self) -> int:
        """Turns sent to another replica than the conversation's previous turn."""
        return sum(a != b for turns in self.served_by.values() for a, b in zip(turns, turns[1:]))
