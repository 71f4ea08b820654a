"""Speculation with a draft model (engine/draft_proposer.py) changes no output: greedy and seeded sampled
requests give the same tokens, text, logprobs and finish reasons as without speculation, with the target's
own int8 copy as the draft and with another tiny model of the same tokenizer, under continuous batching
with more requests than slots, preemption, and a draft pool too small for every row; no compile after
warm-up, and both caches' pages come back. A draft that speaks other tokens is refused at start. On
tensor- and data-parallel meshes (and data x expert): tests/engine/test_speculative_meshes.py."""

import json
import logging
import shutil

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.device.step_inputs import decode_step_shapes
from jaxserve.engine.draft_model import check_draft_matches
from jaxserve.loading.model_source import open_model
from tests.engine.test_speculative import ENGINE, assert_logprobs_equal, assert_nothing_held, summary, workload
from tests.support.fixtures import fixture_dir

SELF_INT8 = {
    "method": "draft",
    "draft_quantization": "int8",
    "num_speculative_tokens": 4,
    "speculative_adaptive": False,
}
# Another model of the same tokenizer, with a pool of 6 pages of 4 tokens: rows evict each other's draft KV
# or find none and propose nothing that step.
OTHER_SMALL_POOL = {
    "method": "draft",
    "draft_model": fixture_dir("llama_mqa_odd"),
    "num_speculative_tokens": 3,
    "draft_num_pages": 7,
    "speculative_adaptive": False,
}


DRAFT_WARNINGS: list[str] = []  # what building the module's engines logged from engine/draft_model.py


@pytest.fixture(scope="module")
def engines():
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: DRAFT_WARNINGS.append(record.getMessage())
    draft_logger = logging.getLogger("jaxserve.engine.draft_model")
    draft_logger.addHandler(handler)
    try:
        return {
            "plain": LLM(fixture_dir("llama_gqa"), **ENGINE),
            "self_int8": LLM(fixture_dir("llama_gqa"), **ENGINE, speculative=SELF_INT8),
            "other": LLM(fixture_dir("llama_gqa"), **ENGINE, speculative=OTHER_SMALL_POOL),
        }
    finally:
        draft_logger.removeHandler(handler)


def assert_draft_holds_nothing(llm):
    assert_nothing_held(llm)
    stats = llm.stats()
    assert stats["speculative_draft_kv_pages_free"] == stats["speculative_draft_kv_pages_total"]
    assert stats["speculative_draft_num_compiles_after_warmup"] == 0
    assert not llm.engine.speculation.proposer.rows


def test_outputs_equal_with_a_draft_model_and_without(engines):
    prompts, params = workload(1, 28)  # 8 slots: continuous batching; 40 pages of 4 tokens: preemption
    results = {name: llm.generate(prompts, params) for name, llm in engines.items()}
    for name in ("self_int8", "other"):
        assert summary(results[name]) == summary(results["plain"]), name
        assert_logprobs_equal(results[name], results["plain"])
        stats = engines[name].stats()
        assert stats["speculative_method"] == "draft"
        assert stats["speculative_num_draft_tokens"] > 20, name
        drafted = sum(o.num_draft_tokens for r in results[name] for o in r.outputs)
        assert drafted == stats["speculative_num_draft_tokens"]
        assert_draft_holds_nothing(engines[name])
    assert engines["self_int8"].stats()["num_preemptions"] > 0
    # the int8 copy agrees with its target far more often than an unrelated (random) model does
    assert engines["self_int8"].stats()["speculative_num_accepted_tokens"] > 100
    rates = {name: engines[name].stats()["speculative_acceptance_rate"] for name in ("self_int8", "other")}
    assert rates["self_int8"] > 0.3 and rates["self_int8"] > 2 * rates["other"], rates
    assert engines["other"].stats()["speculative_draft_rows_without_pages"] > 0


def test_a_long_greedy_run_speculates_nearly_every_token(engines):
    """One long stream: the int8 draft's proposals are mostly accepted, so verify rows emit several
    tokens each; its KV follows the target's across many accept / reject rounds."""
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    reference = engines["plain"].generate([prompt], params)[0].outputs[0].token_ids
    output = engines["self_int8"].generate([prompt], params)[0].outputs[0]
    assert output.token_ids == reference
    assert output.num_accepted_draft_tokens > 45
    assert_draft_holds_nothing(engines["self_int8"])


def test_the_draft_catches_up_in_one_step(engines):
    """A round whose proposals were all accepted leaves the draft two tokens behind (its last proposal, never
    fed, and the target's next token): it feeds both in one two-token step, so every round of a single
    stream costs the draft one step per proposal, where two decode steps made it one more per such round."""
    llm = engines["self_int8"]
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = llm.stats()
    llm.generate([prompt], params)
    after = llm.stats()
    steps, drafted, accepted = (
        after[key] - before[key]
        for key in (
            "speculative_draft_decode_steps",
            "speculative_num_draft_tokens",
            "speculative_num_accepted_tokens",
        )
    )
    # above 3/4 accepted at k = 4, some round had all its proposals accepted
    assert accepted > 0.75 * drafted > 20, (accepted, drafted)
    assert steps == drafted, (steps, drafted)
    assert after["speculative_draft_num_compiles_after_warmup"] == 0
    # the two-token steps were compiled at warm-up, beside the decode buckets
    assert any(shape.query_block == 2 for shape in llm.engine.speculation.proposer.runner.executables)


def test_a_rounds_later_proposals_are_one_dispatch(engines):
    """A round whose rows all want k proposals runs the draft's steps 2..k as one chained executable
    (device/step.py chained_steps): two dispatches per round at k = 4 (the catch-up step and the chain), not
    four; the chained steps compute what one step at a time does (the same proposals, so the same acceptance
    and outputs), and nothing compiles after warm-up."""
    llm = engines["self_int8"]
    proposer = llm.engine.speculation.proposer
    runner = proposer.runner
    assert runner.chain_length == 3
    # one chain per decode bucket, none for other shapes
    assert set(runner.chain_executables) == set(decode_step_shapes(runner.buckets))
    prompt = list(range(7, 40))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    reference = engines["plain"].generate([prompt], params)[0].outputs[0].token_ids
    dispatches: list[tuple[str, int]] = []  # (kind, query_block)
    execute, execute_chain = runner.execute, runner.execute_chain

    def counted_execute(shape, inputs):
        dispatches.append(("step", shape.query_block))
        return execute(shape, inputs)

    def counted_chain(shape, stacked_inputs):
        dispatches.append(("chain", shape.query_block))
        return execute_chain(shape, stacked_inputs)

    rounds: list[tuple[list[int], list[tuple[str, int]]]] = []  # (limits, the round's decode dispatches)
    propose = proposer.propose

    def recorded_propose(seqs, limits):
        dispatches.clear()
        proposals = propose(seqs, limits)
        rounds.append((list(limits), [d for d in dispatches if d[1] <= runner.buckets.catch_up_width]))
        return proposals

    runs = {}
    try:
        runner.execute, runner.execute_chain, proposer.propose = counted_execute, counted_chain, recorded_propose
        for chain in (False, True):
            proposer.chain_steps = chain
            before, rounds_before = llm.stats(), len(rounds)
            output = llm.generate([prompt], params)[0].outputs[0]
            after = llm.stats()
            runs[chain] = (
                output.token_ids,
                *(
                    after[key] - before[key]
                    for key in ("speculative_num_draft_tokens", "speculative_num_accepted_tokens")
                ),
                after["speculative_draft_chained_steps"] - before["speculative_draft_chained_steps"],
                rounds[rounds_before:],
            )
    finally:
        runner.execute, runner.execute_chain, proposer.propose = execute, execute_chain, propose
        proposer.chain_steps = True
    for chain, (tokens, *_, chained, chain_rounds) in runs.items():
        assert tokens == reference, chain
        full = [dispatched for limits, dispatched in chain_rounds if limits == [4]]
        assert len(full) > 5, chain_rounds
        if chain:
            assert all(len(d) == 2 and d[0][0] == "step" and d[1] == ("chain", 1) for d in full), full
            assert chained == 3 * len(full)
        else:
            assert all(len(d) == 4 and all(kind == "step" for kind, _ in d) for d in full), full
            assert chained == 0
    # the same proposals both ways: the same acceptance
    assert runs[True][1:3] == runs[False][1:3]
    assert llm.stats()["speculative_draft_num_compiles_after_warmup"] == 0
    assert_draft_holds_nothing(llm)


def test_a_self_draft_copies_the_targets_kv_where_another_model_prefills(engines):
    """A self-draft's cache has the target's layout: a new row's prompt takes the target's pages (they hold
    those tokens' exact KV) instead of a draft prefill; a draft of another model prefills it. Same outputs. Each
    copy writes the target's pages' keys and values into pages the draft's rows hold."""
    # 13 tokens: at least 3 pages of 4 to take (the small-pool draft holds this row: 6 usable pages)
    prompt = list(range(3, 16))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = engines["plain"].generate([prompt], params)[0].outputs[0].token_ids
    proposer = engines["self_int8"].engine.speculation.proposer
    copy, copied_pages = proposer._copy_pages, []

    def checked_copy(source, dest, source_pages, dest_pages):
        # a row's page i takes its sequence's page i (the same positions), and holds its keys and values after
        running = {seq.seq_id: seq for scheduler in engines["self_int8"].engine.schedulers for seq in scheduler.running}
        same_positions = {
            pair for seq_id, row in proposer.rows.items() for pair in zip(running[seq_id].page_ids, row.page_ids)
        }
        assert set(zip(source_pages, dest_pages)) <= same_positions
        dest = copy(source, dest, source_pages, dest_pages)
        for target_layer, draft_layer in zip(source.keys + source.values, dest.keys + dest.values):
            assert np.array_equal(np.asarray(draft_layer)[dest_pages], np.asarray(target_layer)[source_pages])
        copied_pages.extend(dest_pages)
        return dest

    proposer._copy_pages = checked_copy
    try:
        for name, copies in (("self_int8", True), ("other", False)):
            llm = engines[name]
            before = llm.stats()
            assert llm.generate([prompt], params)[0].outputs[0].token_ids == reference, name
            after = llm.stats()
            copied, prefills = (
                after[key] - before[key]
                for key in ("speculative_draft_copied_pages", "speculative_draft_prefill_steps")
            )
            assert (copied >= 3 and prefills == 0) if copies else (copied == 0 and prefills > 0), (name, copied)
            assert_draft_holds_nothing(llm)
    finally:
        proposer._copy_pages = copy
    assert len(copied_pages) >= 3


def test_a_self_draft_told_not_to_copy_prefills(engines):
    llm = LLM(fixture_dir("llama_gqa"), **ENGINE, speculative={**SELF_INT8, "draft_kv_from_target": False})
    prompt, params = list(range(3, 16)), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = engines["plain"].generate([prompt], params)[0].outputs[0].token_ids
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected
    stats = llm.stats()
    assert stats["speculative_draft_copied_pages"] == 0 and stats["speculative_draft_prefill_steps"] > 0
    assert_draft_holds_nothing(llm)


def test_draft_kv_from_target_is_refused_where_the_caches_differ():
    with pytest.raises(ValueError, match="draft_kv_from_target: true cannot be served: the draft's KV pages differ"):
        LLM(fixture_dir("llama_gqa"), **ENGINE, speculative={**OTHER_SMALL_POOL, "draft_kv_from_target": True})


def test_metrics_report_the_draft_methods_acceptance(engines):
    from prometheus_client import generate_latest

    from jaxserve.server.metrics import ServerMetrics

    stats = engines["self_int8"].stats()
    metrics = ServerMetrics()
    metrics.observe_engine(stats)
    text = generate_latest(metrics.registry).decode()
    assert f"jaxserve_spec_decode_accepted_tokens {float(stats['speculative_num_accepted_tokens'])}" in text
    assert f"jaxserve_spec_decode_acceptance_rate {stats['speculative_acceptance_rate']}" in text


def _copy_with_config(tmp_path, name: str, **changes) -> str:
    copy = tmp_path / name
    shutil.copytree(fixture_dir("llama_mqa_odd"), copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return str(copy)


def test_a_draft_of_other_tokens_is_refused_at_start(tmp_path):
    target = open_model(fixture_dir("llama_gqa"))
    check_draft_matches(open_model(fixture_dir("llama_mqa_odd")), target, 128)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens"):
        check_draft_matches(open_model(_copy_with_config(tmp_path, "vocab", vocab_size=400)), target, 128)
    with pytest.raises(ValueError, match="another tokenizer than the target.*EOS ids differ"):
        check_draft_matches(open_model(_copy_with_config(tmp_path, "eos", eos_token_id=5)), target, 128)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        check_draft_matches(open_model(_copy_with_config(tmp_path, "short", max_position_embeddings=64)), target, 128)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens"):  # through the engine's start-up
        LLM(
            fixture_dir("llama_gqa"),
            **ENGINE,
            speculative={"method": "draft", "draft_model": str(tmp_path / "vocab")},
        )


@pytest.mark.parametrize(
    "speculative, problem",
    [
        ({"method": "draft"}, "needs draft_quantization int8 or int4"),
        ({"method": "draft", "draft_quantization": "int3"}, "unknown draft_quantization"),
        ({"method": "draft", "draft_model": ""}, "draft_model must name a model source"),
        ({"method": "draft", "draft_quantization": "int4", "draft_num_pages": 1}, "draft_num_pages"),
        ({"method": "draft", "draft_quantization": "int4", "num_speculative_tokens": 16}, "num_speculative_tokens"),
        ({"method": "ngram", "draft_kv_from_target": True}, "draft_kv_from_target apply to method draft"),
        ({"method": "draft", "draft_quantization": "int4", "draft_kv_from_target": 1}, "draft_kv_from_target must be"),
    ],
)
def test_bad_draft_options_are_refused(speculative, problem):
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match=problem):
        EngineConfig.from_options(speculative=speculative)


def test_a_draft_pool_below_one_sequence_is_named_at_start(engines):
    """A pool that cannot hold one sequence of max_model_len leaves long rows without proposals: said once, at
    start. The module's small-pool draft (7 pages of 4 tokens) logged it; the self-draft (pool sized) did not."""
    from jaxserve.engine.draft_model import short_pool_warning

    assert [w for w in DRAFT_WARNINGS if "draft's KV pool" in w] == [
        short_pool_warning(7, 4, engines["other"].engine.max_model_len)
    ]

    assert short_pool_warning(9, 4, 32) is None  # 8 usable pages of 4 tokens: one whole sequence
    warning = short_pool_warning(7, 4, 64)
    assert warning is not None and "holds 24 tokens" in warning and "max_model_len 64" in warning
    assert "draft_num_pages" in warning


def test_a_draft_on_a_prefill_replica_is_refused():
    from jaxserve.config import EngineConfig

    EngineConfig.from_options(speculative=SELF_INT8, data_parallel_size=2)  # served: per-rank draft pools
    with pytest.raises(ValueError, match="prefill replica"):
        EngineConfig.from_options(speculative=SELF_INT8, role="prefill")


def test_a_draft_quantization_the_shapes_cannot_take_is_named_as_the_drafts():
    """llama_mqa_odd's hidden 40 takes no int4 group: the refusal says the draft's option asked for it."""
    with pytest.raises(ValueError, match=r"the speculative draft \(self, draft_quantization int4\): cannot quantize"):
        LLM(fixture_dir("llama_mqa_odd"), **ENGINE, speculative={"method": "draft", "draft_quantization": "int4"})
