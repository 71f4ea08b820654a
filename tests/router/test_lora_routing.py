"""A LoRA request's pages chain from its adapter's identity in the engine's cache; the router keys it the same
way from what the replica reports (ReplicaLoad.lora_root_keys, sent with every KV event batch), so its mirror
of a real engine's cache finds the adapter's pages for the adapter's requests and not for the base model's.
The policy on fake replicas: an adapter request goes where its adapter's pages are, not where the same
tokens are cached for the base model, and finds nothing on a replica that has not reported the adapter."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.router.cache_view import CacheView
from jaxserve.router.policy import PrefixPolicy, RouteRequest, replica_keys
from jaxserve.server.kv_events_service import load_to_proto
from tests.lora.support import BASE_MODEL, adapter_dir
from tests.router.test_policy import SYSTEM, FakeReplica
from tests.support.fixtures import SMALL_ENGINE

ADAPTER = "attn_r4"
PAGE_SIZE = 16  # SMALL_ENGINE's
PROMPT = list(range(3, 3 + 5 * PAGE_SIZE + 3))  # 5 full pages, the last of them cacheable


class EngineReplica:
    """What the router knows of a replica, taken from an engine as SubscribeKVEvents would send it."""

    def __init__(self, llm: LLM):
        sequence, events, _ = llm.engine.kv_events().snapshot()
        self.view, self.page_size = CacheView(), llm.engine.config.cache.page_size
        self.view.reset(sequence, events)
        self.load = load_to_proto(llm.stats())


@pytest.fixture(scope="module")
def llm():
    """The executables of tests/disagg/test_lora_unload.py's engine (one slot, one decode and one prefill
    bucket): the persistent compilation cache serves both."""
    options = {**SMALL_ENGINE, "max_num_seqs": 1, "decode_seq_buckets": (1,), "prefill_token_buckets": (64,)}
    lora = {"adapters": {ADAPTER: adapter_dir(ADAPTER)}, "max_rank": 8}
    llm = LLM(BASE_MODEL, lora=lora, **options)
    assert llm.engine.config.cache.page_size == PAGE_SIZE
    return llm


def test_the_routers_keys_find_an_engines_adapter_pages(llm):
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, lora=ADAPTER))
    replica = EngineReplica(llm)
    assert dict(replica.load.lora_root_keys) == {ADAPTER: llm.engine.parts.lora.resolve(ADAPTER).identity}
    adapter_match = replica.view.match(replica_keys(replica, RouteRequest(PROMPT, lora=ADAPTER)))
    assert adapter_match.num_device_pages == 5
    assert replica.view.match(replica_keys(replica, RouteRequest(PROMPT))).num_pages == 0  # base: other keys
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    replica = EngineReplica(llm)
    assert replica.view.match(replica_keys(replica, RouteRequest(PROMPT))).num_device_pages == 5
    assert replica.view.match(replica_keys(replica, RouteRequest(PROMPT, lora="other"))).num_pages == 0


def test_an_adapter_request_goes_where_its_adapters_pages_are():
    identity = 1234567
    base, adapter, unreported = FakeReplica("base"), FakeReplica("adapter"), FakeReplica("unreported")
    base.cache(SYSTEM)  # the same tokens, for the base model
    adapter.cache(SYSTEM, root_key=identity)
    unreported.cache(SYSTEM, root_key=identity)  # its load does not name the adapter (yet)
    for replica in (base, adapter):
        replica.load.lora_root_keys["ad"] = identity
    request = RouteRequest(SYSTEM + [7] * 20, lora="ad")
    choice = PrefixPolicy().choose(request, [base, unreported, adapter])
    assert choice.replica is adapter and choice.num_hit_tokens == len(SYSTEM)
    assert PrefixPolicy().choose(RouteRequest(SYSTEM + [7] * 20), [adapter, base]).replica is base
    assert replica_keys(unreported, request) == [] and replica_keys(base, request) == request.keys(16, identity)
