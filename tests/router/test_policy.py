"""The routing policies on fake replicas (a CacheView fed STORED events and a load): no servers."""

from collections import Counter

import pytest

from jaxserve.host.kv_events import DEVICE, HOST, STORED, KVEvent
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.cache_view import CacheView
from jaxserve.router.policy import (
    LeastLoadPolicy,
    PrefixPolicy,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
    predict,
    with_adapter,
)
from tests.router.workload_sim import Workload

PAGE_SIZE = 16
SYSTEM = list(range(3, 3 + 8 * PAGE_SIZE))  # an 8-page system prompt


class FakeReplica:
    def __init__(self, address: str, prefill_seconds_per_token: float = 1e-3, swap_in_seconds_per_page: float = 0.0):
        self.address, self.page_size, self.is_up, self.max_num_seqs = address, PAGE_SIZE, True, 0
        self.view = CacheView()
        self.view.reset(0, [])
        self.load = pb.ReplicaLoad(
            prefill_seconds_per_token=prefill_seconds_per_token, swap_in_seconds_per_page=swap_in_seconds_per_page
        )
        self.load.num_free_pages = 1000
        self.num_outstanding = self.outstanding_prefill_tokens = self.outstanding_pages = 0

    def cache(self, token_ids: list[int], tier: str = DEVICE, num_pages: int | None = None, root_key: int = 0) -> None:
        keys = RouteRequest(token_ids + [0]).keys(PAGE_SIZE, root_key)[:num_pages]
        parents = [root_key] + keys[:-1]
        self.view.reset(0, [KVEvent(STORED, key, parent, PAGE_SIZE, tier) for key, parent in zip(keys, parents)])


def request(suffix: int = 0, session_id: str = "") -> RouteRequest:
    return RouteRequest(SYSTEM + [suffix + 1] * 20, session_id)


def test_prefix_goes_where_the_prefix_is_cached():
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    replicas[1].cache(SYSTEM)
    choice = PrefixPolicy().choose(request(), replicas)
    assert choice.replica is replicas[1] and choice.num_hit_tokens == len(SYSTEM)
    assert choice.ttft == pytest.approx(20 * 1e-3)


def test_a_loaded_replica_loses_its_prefix_advantage():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    replicas[0].cache(SYSTEM)
    replicas[0].load.num_tokens_waiting_prefill = 1000  # a queue longer than the whole prompt
    assert PrefixPolicy().choose(request(), replicas).replica is replicas[1]
    replicas[0].load.num_tokens_waiting_prefill = 50
    assert PrefixPolicy().choose(request(), replicas).replica is replicas[0]


def test_the_routers_own_outstanding_tokens_count_before_the_replica_reports_them():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    replicas[0].cache(SYSTEM)
    replicas[0].num_outstanding, replicas[0].outstanding_prefill_tokens = 1, 1000
    assert PrefixPolicy().choose(request(), replicas).replica is replicas[1]


def test_host_tier_pages_cost_their_swap_in():
    device, host = FakeReplica("device"), FakeReplica("host", swap_in_seconds_per_page=1e-3)
    device.cache(SYSTEM, num_pages=4)  # half the system prompt on the device
    host.cache(SYSTEM, tier=HOST)  # all of it in the host tier: 8 swap-ins of 1 ms beat 64 tokens of 1 ms
    choice = PrefixPolicy().choose(request(), [device, host])
    assert choice.replica is host and choice.match.num_host_pages == 8
    assert choice.ttft == pytest.approx(8 * 1e-3 + 20 * 1e-3)
    host.load.swap_in_seconds_per_page = 0.1  # a slow host link: recomputing is cheaper
    assert PrefixPolicy().choose(request(), [device, host]).replica is device


def test_ties_and_cold_prefixes_go_by_load():
    replicas = [FakeReplica(name) for name in "abc"]
    replicas[0].load.num_running, replicas[1].load.num_running, replicas[2].load.num_running = 5, 1, 3
    assert PrefixPolicy().choose(request(), replicas).replica is replicas[1]


def test_pages_routed_a_moment_ago_count_as_hits_before_their_events_arrive():
    """Requests sharing a prefix, each routed once the one before has started streaming but before any
    page event has arrived, go to one replica: the first one's pages are pending hits there."""
    replicas = [FakeReplica(name) for name in "abc"]
    policy, chosen = PrefixPolicy(), []
    for suffix in range(3):
        choice = policy.choose(request(suffix), replicas)
        choice.replica.view.note_routed(request(suffix).keys(PAGE_SIZE))
        chosen.append(choice.replica.address)
    assert len(set(chosen)) == 1


def test_the_prediction_counts_the_prompt_tokens_the_cache_does_not_cover():
    replica = FakeReplica("a")
    replica.cache(SYSTEM, num_pages=3)
    prediction = predict(replica, request(), [replica])
    assert prediction.num_uncached_tokens == len(SYSTEM) + 20 - 3 * PAGE_SIZE


def test_round_robin_cycles():
    replicas = [FakeReplica(name) for name in "abc"]
    policy = RoundRobinPolicy()
    assert [policy.choose(request(), replicas).replica.address for _ in range(6)] == list("abcabc")


def test_least_load_takes_the_emptiest():
    replicas = [FakeReplica(name) for name in "abc"]
    replicas[0].num_outstanding, replicas[2].load.num_waiting = 2, 1
    assert LeastLoadPolicy().choose(request(), replicas).replica.address == "b"


def test_sessions_stick_and_a_removed_replica_moves_only_its_own():
    replicas = [FakeReplica(name) for name in "abcd"]
    policy = SessionPolicy()
    before = {f"s{i}": policy.choose(request(session_id=f"s{i}"), replicas).replica.address for i in range(200)}
    assert all(
        policy.choose(request(i, session_id=s), replicas).replica.address == address
        for i, (s, address) in enumerate(before.items())
    )
    assert min(Counter(before.values()).values()) > 20  # spread over all four
    remaining = [r for r in replicas if r.address != "b"]
    after = {s: policy.choose(request(session_id=s), remaining).replica.address for s in before}
    assert all(after[s] == before[s] for s in before if before[s] != "b")
    assert PrefixPolicy().choose(request(), replicas)  # and no session id: by load
    assert policy.choose(request(), replicas).replica.address == "a"


def test_a_replica_without_free_pages_for_the_request_is_passed_over():
    """Admission waits for room for prompt + max_tokens: a replica without it would keep the request
    waiting for running sequences to finish, however much of the prompt it has cached."""
    full, roomy = FakeReplica("full"), FakeReplica("roomy")
    full.cache(SYSTEM)
    full.load.num_free_pages = 5  # the prompt needs 10 pages (148 tokens + 16), 8 of them cached: 2 free ones
    assert PrefixPolicy().choose(request(), [full, roomy]).replica is full
    full.outstanding_pages = 4  # ... but the router has sent requests there that will take 4 of the 5
    assert PrefixPolicy().choose(request(), [full, roomy]).replica is roomy
    roomy.load.num_free_pages = 0  # neither has room: the better prediction
    assert PrefixPolicy().choose(request(), [full, roomy]).replica is full


def test_a_replica_with_slow_steps_makes_new_requests_wait():
    fast, slow = FakeReplica("fast"), FakeReplica("slow")
    fast.load.step_seconds, slow.load.step_seconds = 0.01, 0.5
    assert PrefixPolicy().choose(request(), [slow, fast]).replica is fast
    # 148 uncached tokens at 1 ms each: 0.3 s of prefill in steps of 0.5 s; plus half the step under way
    assert predict(slow, request(), [slow]).ttft == pytest.approx(0.25 + 0.5)
    slow.load.step_seconds = 0.1
    assert predict(slow, request(), [slow]).ttft == pytest.approx(0.05 + 0.2)


def test_predictions_less_than_a_step_apart_keep_the_prompt_where_it_is_cached():
    """Step times are measured, and noisy: a replica whose last steps were a little slower keeps a
    conversation whose pages it holds, unless the other is faster by more than a step."""
    home, other = FakeReplica("home", 0.02 / 48), FakeReplica("other", 0.01 / 48)
    home.load.step_seconds, other.load.step_seconds = 0.02, 0.01
    home.cache(SYSTEM, num_pages=6)  # the prompt is 8 pages + 20 tokens: 52 uncached here (2 steps), 148 there (4)
    home_prediction, other_prediction = (predict(r, request(), [home, other]) for r in (home, other))
    assert other_prediction.ttft < home_prediction.ttft < other_prediction.ttft + 0.015
    assert PrefixPolicy().choose(request(), [home, other]).replica is home
    home.load.step_seconds, home.load.prefill_seconds_per_token = 0.2, 0.2 / 48  # ten times slower: it loses
    assert PrefixPolicy().choose(request(), [home, other]).replica is other


def test_right_after_start_up_the_replica_holding_the_prompt_gets_it():
    """Fresh replicas have measured nothing yet (step time 0): they are predicted with their peers' step time,
    not as free, so the one that holds the prompt keeps it."""
    fresh, home, other = FakeReplica("fresh", 0.0), FakeReplica("home", 0.1 / 256), FakeReplica("other", 0.0)
    home.load.step_seconds = 0.1  # 256 prompt tokens a step: the whole prompt would fit in one
    home.cache(SYSTEM)
    assert PrefixPolicy().choose(request(), [fresh, home, other]).replica is home
    home.load.step_seconds = home.load.prefill_seconds_per_token = 0.0  # nobody has measured yet
    assert PrefixPolicy().choose(request(), [fresh, home, other]).replica is home


def test_a_replica_without_a_free_sequence_slot_is_passed_over():
    """At max_num_seqs a new request waits for a running sequence to finish, however much of it is cached."""
    full, roomy = FakeReplica("full"), FakeReplica("roomy")
    full.max_num_seqs = roomy.max_num_seqs = 4
    full.cache(SYSTEM)
    full.load.num_running, full.num_outstanding = 3, 1
    assert PrefixPolicy().choose(request(), [full, roomy]).replica is roomy
    roomy.load.num_waiting = 4  # neither has a slot: the better prediction
    assert PrefixPolicy().choose(request(), [full, roomy]).replica is full


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_multi_turn_workload_keeps_every_replica_busy_and_each_conversation_home(seed):
    """Conversations sharing a system prompt arrive over 5 s on 3 simulated replicas. The replica that cached
    the system prompt first used to win every new conversation (it saves that prefill) until its sequence
    slots filled, leaving the others idle; its queue then waited for slots. Now each replica gets work, and
    each conversation stays where its history is cached."""
    workload = Workload(PrefixPolicy(), seed=seed)
    workload.run(arrival_spread=5.0, answer_tokens=128)
    per_replica = workload.requests_per_replica()
    assert set(per_replica) == {"a", "b", "c"}
    assert min(per_replica.values()) >= 0.15 * len(workload.requests), per_replica
    assert workload.num_moves() <= 0.05 * len(workload.requests)
    assert workload.hit_rate() > 0.9
    sticky = Workload(SessionPolicy(), seed=seed)  # sessions spread evenly and never move: a fair yardstick
    sticky.run(arrival_spread=5.0, answer_tokens=128)
    assert workload.mean_ttft() < 1.25 * sticky.mean_ttft()


def test_a_lora_request_goes_to_a_replica_that_reports_its_adapter():
    """An adapter loaded at run time on one replica (or lost by another's restart): the others would refuse it as an
    unknown adapter, so the policy chooses among those reporting it, whatever their caches hold."""
    with_it, without = FakeReplica("with"), FakeReplica("without")
    with_it.load.lora_root_keys["late"] = 77
    prompt = list(range(64))
    without.cache(prompt)  # the base model's pages of the prompt: a base request would go here
    replicas = [without, with_it]
    request = RouteRequest(prompt, lora="late")
    assert with_adapter(request, replicas) == [with_it]
    assert PrefixPolicy().choose(request, with_adapter(request, replicas)).replica is with_it
    assert PrefixPolicy().choose(RouteRequest(prompt), with_adapter(RouteRequest(prompt), replicas)).replica is without
    nowhere = RouteRequest(prompt, lora="unknown")  # reported nowhere: every replica, which refuses it with a reason
    assert with_adapter(nowhere, replicas) == replicas
