"""A decode replica's reservations (jaxserve/disagg/decode_side.py) against its own cache and scheduler."""

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.device.page_copies import host_pages_to_array
from jaxserve.disagg.handover import DisaggregatedPair
from jaxserve.disagg.metadata import PrefilledRequest
from tests.support.fixtures import SMALL_ENGINE, fixture_dir


def test_a_page_demoted_by_a_reservation_reaches_the_host_tier_unchanged():
    engine = {**SMALL_ENGINE, "page_size": 8}
    prefill = LLM(fixture_dir("llama_gqa"), role="prefill", **engine).engine
    decode = LLM(fixture_dir("llama_gqa"), role="decode", **{**engine, "num_pages": 8, "swap_space": 0.01}).engine
    allocator = decode.schedulers[0].allocator
    assert allocator.host_tier is not None
    rng = np.random.default_rng(5)
    warm = [1] + rng.integers(3, 384, size=15).tolist()  # two full pages of 8, cached on the decode side
    decode.add_request("warm", warm, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while decode.has_unfinished_requests():
        decode.step()
    found = allocator.find_cached_prefix(warm, len(warm))
    assert len(found.pages) == 2
    saved = {key: host_pages_to_array(decode.runner.read_pages([page])) for key, page in zip(found.keys, found.pages)}
    # a 48-token prompt (6 pages, 7 with its reply) takes the 5 free pages and evicts (demotes) a cached one
    prompt = [1] + rng.integers(3, 384, size=47).tolist()
    DisaggregatedPair(prefill, decode).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    demoted = [key for key in saved if key in allocator.host_tier.entries]
    assert demoted
    for key in demoted:
        np.testing.assert_array_equal(host_pages_to_array([allocator.host_tier.entries[key][1]]), saved[key])


def test_a_reservation_keeps_its_sequence_slot():
    decode = LLM(fixture_dir("llama_gqa"), role="decode", **{**SMALL_ENGINE, "max_num_seqs": 2}).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {f"h{i}": list(range(3 + 20 * i, 11 + 20 * i)) for i in range(3)}
    assert decode.handovers.reserve("h0", prompts["h0"], params)
    assert decode.handovers.reserve("h1", prompts["h1"], params)
    assert decode.handovers.reserve("h2", prompts["h2"], params) is None  # both slots are reserved
    decode.add_request("h2", prompts["h2"], params)  # so decode_service runs it whole here
    decode.step()
    for i in range(2):  # the prefill replicas answer (the KV's contents do not matter here)
        decode.handovers.complete(PrefilledRequest(f"h{i}", prompts[f"h{i}"], params, 0, 5, None))
    while decode.has_unfinished_requests():
        decode.step()
    stats = decode.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and not decode.requests


def test_a_handover_waits_for_a_slot_in_order_and_prefills_here_after_the_timeout():
    decode = LLM(fixture_dir("llama_gqa"), role="decode", **{**SMALL_ENGINE, "max_num_seqs": 1}).engine
    handovers, now = decode.handovers, [0.0]
    handovers.clock = lambda: now[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = {f"q{i}": list(range(3 + 20 * i, 11 + 20 * i)) for i in range(4)}
    answers: dict[str, tuple] = {}
    for request_id in ("q0", "q1", "q2", "q3"):
        handovers.reserve_or_queue(
            request_id,
            prompts[request_id],
            params,
            lambda r, timed_out, i=request_id: answers.update({i: (r, timed_out)}),
        )
    assert list(answers) == ["q0"] and [q.request_id for q in handovers.queued] == ["q1", "q2", "q3"]
    handovers.cancel("q2")  # the RPC ended while waiting
    assert answers["q2"] == (None, False) and [q.request_id for q in handovers.queued] == ["q1", "q3"]
    handovers.complete(PrefilledRequest("q0", prompts["q0"], params, 0, 5, None))
    while "q1" not in answers:  # q0 decodes its last token and leaves: q1 takes the slot
        decode.step()
    assert answers["q1"][0] is not None and answers["q1"][0].request_id == "q1"
    now[0] = handovers.timeout + 1  # q3 waited too long: the caller prefills it here
    handovers.reserve_queued()
    assert answers["q3"] == (None, True) and decode.stats()["handover_local_prefills"] == 1
    handovers.cancel("q1")
    while decode.has_unfinished_requests():
        decode.step()
    stats = decode.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["handover_queued"] == 0
