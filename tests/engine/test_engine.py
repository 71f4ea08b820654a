"""End-to-end behaviour of the engine on a tiny checkpoint: batching, compilation, sampling, bad input."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.device.step_inputs import all_step_shapes
from tests.support.fixtures import DERIVED_BUCKETS, SMALL_ENGINE, expected, fixture_dir

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def random_prompts(count, rng, low=1, high=90):
    return [[1] + rng.integers(3, 384, size=int(n)).tolist() for n in rng.integers(low, high, size=count)]


def test_batch_invariance_and_no_compiles_after_warmup():
    # the derived decode buckets (1, 4, 16, 32): the same tokens alone and in a crowd, whatever the bucket
    # with decode chains (engine/decode_chain.py): the lone stream decodes in chains, the crowd in steps
    llm = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "max_num_seqs": 32, "num_scheduler_steps": 4})
    rng = np.random.default_rng(0)
    target = expected("llama_gqa")["prompts"][5]
    others = random_prompts(30, rng)
    lengths = rng.integers(1, 30, size=30)
    params = [GREEDY] + [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in lengths]
    alone = llm.generate([target["token_ids"]], GREEDY)[0].outputs[0].token_ids
    together = llm.generate([target["token_ids"]] + others, params)
    assert alone == target["greedy_token_ids"][:12]
    assert together[0].outputs[0].token_ids == alone
    assert [len(o.outputs[0].token_ids) for o in together[1:]] == lengths.tolist()
    stats = llm.stats()
    assert stats["num_compiles_after_warmup"] == 0
    runner = llm.engine.runner
    # every step shape, and the decode chains of the buckets of up to 8 rows (engine/decode_chain.py)
    assert stats["num_executables"] == len(
        all_step_shapes(runner.buckets, llm.engine.config.scheduler.prefill_query_block)
    ) + len(runner.chain_shapes())
    assert {shape.num_seqs for shape in runner.chain_shapes()} == {1, 4}
    assert stats["kv_pages_free"] == stats["kv_pages_total"], "every page is free once all requests finish"


def test_tiny_cache_preempts_and_outputs_are_unchanged():
    # Each sequence grows to 4 pages; two are admitted at once into 7 usable pages, so they must
    # preempt each other as they grow.
    prompts = random_prompts(4, np.random.default_rng(2), low=16, high=17)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE).generate(prompts, params)
    for caching in (True, False):
        tiny = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "num_pages": 8, "enable_prefix_caching": caching})
        cramped = tiny.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]
        assert tiny.stats()["num_preemptions"] > 0
        assert tiny.stats()["kv_pages_free"] == tiny.stats()["kv_pages_total"]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama_llm):
    prompt = expected("llama_gqa")["prompts"][3]["token_ids"]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llama_llm.generate([prompt], seeded)[0].outputs[0].token_ids
    rng = np.random.default_rng(1)
    crowd = llama_llm.generate(
        [prompt] + random_prompts(6, rng), [seeded] + [SamplingParams(max_tokens=8, temperature=0.8)] * 6
    )
    assert crowd[0].outputs[0].token_ids == alone
    other_seed = llama_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99))
    assert other_seed[0].outputs[0].token_ids != alone


def test_sampling_filters(llama_llm):
    prompt = expected("llama_gqa")["prompts"][4]
    greedy = prompt["greedy_token_ids"][:10]
    top1 = SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3)
    assert llama_llm.generate([prompt["token_ids"]], top1)[0].outputs[0].token_ids == greedy
    tiny_p = SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3)
    assert llama_llm.generate([prompt["token_ids"]], tiny_p)[0].outputs[0].token_ids == greedy
    min_p = SamplingParams(max_tokens=10, temperature=1.0, min_p=1.0, seed=3)
    assert llama_llm.generate([prompt["token_ids"]], min_p)[0].outputs[0].token_ids == greedy
    # top_k=3 only ever picks among the three most likely tokens
    out = llama_llm.generate(
        [prompt["token_ids"]], SamplingParams(max_tokens=1, temperature=5.0, top_k=3, n=8, logprobs=3, seed=5)
    )[0]
    for completion in out.outputs:
        top3 = sorted(completion.logprobs[0].items(), key=lambda kv: -kv[1])[:3]
        assert completion.token_ids[0] in {t for t, _ in top3}


def test_n_samples_differ_and_logprobs_are_consistent(llama_llm):
    prompt = expected("llama_gqa")["prompts"][6]["token_ids"]
    out = llama_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, n=3, logprobs=2, seed=7))[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == 8
        for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
            assert token_id in logprobs and len(logprobs) <= 3
            assert all(v <= 0 for v in logprobs.values())


def test_stop_strings_and_stop_tokens(llama_llm):
    prompt = expected("llama_gqa")["prompts"][0]
    full = llama_llm.generate([prompt["token_ids"]], GREEDY)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    stopped = llama_llm.generate([prompt["token_ids"]], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and full.text.startswith(stopped.text)
    assert stopped.text == full.text[: full.text.index(stop)]
    stop_token = full.token_ids[3]
    by_token = llama_llm.generate(
        [prompt["token_ids"]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token])
    )[0].outputs[0]
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    # as vLLM's detokenizer: the stop token's id is in the output, its text only with include_stop_str_in_output
    tokenizer = llama_llm.get_tokenizer()
    prompt_text = tokenizer.decode(prompt["token_ids"], skip_special_tokens=True)
    with_stop = tokenizer.decode(prompt["token_ids"] + by_token.token_ids, skip_special_tokens=True)[len(prompt_text) :]
    without = tokenizer.decode(prompt["token_ids"] + by_token.token_ids[:-1], skip_special_tokens=True)
    assert by_token.text == without[len(prompt_text) :] and by_token.text != with_stop
    included = llama_llm.generate(
        [prompt["token_ids"]],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert included.text == with_stop and included.token_ids == by_token.token_ids
    # vLLM's stop_reason says which stop ended it; the shortest of two stops that begin at one place ends first
    assert stopped.stop_reason == stop and by_token.stop_reason == stop_token and full.stop_reason is None
    longer = full.text[2:6]
    both = llama_llm.generate(
        [prompt["token_ids"]], SamplingParams(max_tokens=12, temperature=0.0, stop=[longer, stop, "\x00never"])
    )[0].outputs[0]
    assert both.stop_reason == stop and both.text == stopped.text
    kept = llama_llm.generate(
        [prompt["token_ids"]],
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == stopped.text + stop and kept.token_ids == stopped.token_ids


def test_vllm_prompt_dicts_max_tokens_none_and_cumulative_logprob(llama_llm):
    prompt = expected("llama_gqa")["prompts"][0]
    ids = prompt["token_ids"]
    plain = llama_llm.generate([ids], GREEDY)[0]
    # a single dict is one prompt (not its keys), a list may mix the forms
    one = llama_llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain.outputs[0].token_ids
    mixed = llama_llm.generate([{"prompt_token_ids": ids}, ids, {"prompt": "hello"}], GREEDY)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [plain.outputs[0].token_ids] * 2
    assert mixed[2].prompt == "hello" and mixed[2].prompt_token_ids == llama_llm.get_tokenizer().encode("hello")
    for bad in ({"prompt": "a", "multi_modal_data": {}}, {}, {"prompt_token_ids": "abc"}):
        with pytest.raises(ValueError, match="prompt"):
            llama_llm.generate([ids, bad], GREEDY)
    assert not llama_llm.engine.has_unfinished_requests()
    # max_tokens None: up to max_model_len (vLLM's "until the context ends")
    unbounded = llama_llm.generate([ids], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    room = llama_llm.engine.parts.max_model_len - len(ids)
    assert len(unbounded.outputs[0].token_ids) == room and unbounded.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        llama_llm.generate([ids], SamplingParams(max_tokens=None, min_tokens=room + 1))
    with pytest.raises(ValueError, match="no room"):
        llama_llm.generate([[1] * llama_llm.engine.parts.max_model_len], SamplingParams(max_tokens=None))
    # cumulative_logprob: the sampled tokens' logprobs summed, only with logprobs asked for
    scored = llama_llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))[0].outputs[0]
    total = sum(lp[t] for t, lp in zip(scored.token_ids, scored.logprobs))
    assert scored.cumulative_logprob == pytest.approx(total) and scored.cumulative_logprob < 0
    assert plain.outputs[0].cumulative_logprob is None


def test_eos_stops_unless_ignored(llama_llm):
    prompt = expected("llama_gqa")["prompts"][2]["token_ids"]
    outputs = llama_llm.engine.outputs  # the output processor decides what stops
    first = llama_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0].outputs[0].token_ids[0]
    outputs.eos_token_ids, saved = frozenset([first]), outputs.eos_token_ids
    try:
        stopped = llama_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0].outputs[0]
        ignored = llama_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    finally:
        outputs.eos_token_ids = saved
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert len(ignored.outputs[0].token_ids) == 3 and ignored.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([1, 384], GREEDY, "outside the vocabulary"),
        ([1, -3], GREEDY, "outside the vocabulary"),
        ([], GREEDY, "empty"),
        ([1] * 120, SamplingParams(max_tokens=20), "max_model_len"),
        ([1, 2], SamplingParams(max_tokens=2, logprobs=50), "max_logprobs"),
        ([1, "a"], GREEDY, "token ids"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(llama_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llama_llm.generate([prompt], params)
    good = expected("llama_gqa")["prompts"][4]
    assert llama_llm.generate([good["token_ids"]], GREEDY)[0].outputs[0].token_ids == good["greedy_token_ids"][:12]
    assert not llama_llm.engine.has_unfinished_requests()


def test_an_empty_text_prompt_is_the_tokens_the_tokenizer_adds(llama_llm):
    # vLLM encodes "" too: [BOS] where the tokenizer adds one (a tokenizer that adds nothing gives [], refused above)
    bos = llama_llm.get_tokenizer().encode("")
    assert bos == [1]
    output = llama_llm.generate("", GREEDY)[0]
    assert output.prompt_token_ids == bos
    assert output.outputs[0].token_ids == llama_llm.generate([bos], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n must"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_engine_option():
    with pytest.raises(ValueError, match="unknown engine options"):
        LLM(fixture_dir("llama_gqa"), max_num_seq=4)


def test_expert_load_is_reported_and_follows_routing():
    llm = LLM(fixture_dir("mixtral"), **SMALL_ENGINE)
    assert "expert_tokens" not in LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE).stats()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[1] + [5] * 29], params)  # one distinct token, repeated: a skewed load
    first = np.asarray(llm.stats()["expert_tokens"])
    assert first.shape == (2, 4)
    top_k = 2
    # every real token passes every layer and picks top_k experts; the 30-token prompt is the only work
    assert first.sum(axis=1).tolist() == [30 * top_k] * 2, "padding tokens are not counted"
    llm.generate([[1] + np.random.default_rng(0).integers(3, 384, size=40).tolist()], params)
    second = np.asarray(llm.stats()["expert_tokens"]) - first
    assert second.sum(axis=1).tolist() == [41 * top_k] * 2
    assert not np.allclose(first / first.sum(), second / second.sum()), "the report follows the routing"
    assert llm.stats()["expert_load_max_over_mean"] >= 1.0


def test_stats_report_device_bytes_of_weights_and_kv_pages():
    from jaxserve.models import KVPages

    llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "num_pages": 32})
    stats, config = llm.stats(), llm.engine.model_config
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in llm.engine.runner.param_leaves)
    assert stats["weights_device_bytes"] == weights > 0
    page_bytes = KVPages.bytes_per_page(config.num_layers, 16, config.num_kv_heads, config.head_dim, "float32")
    assert stats["kv_cache_device_bytes"] == 32 * page_bytes
    # summed once at the start (the server reads stats after every step): steps return new pools of the same
    # sizes, and the figures still describe what the runner holds after them
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
    runner = llm.engine.runner
    after = llm.stats()
    assert after["weights_device_bytes"] == sum(leaf.nbytes for leaf in runner.param_leaves) == weights
    assert after["kv_cache_device_bytes"] == sum(leaf.nbytes for leaf in jax.tree.leaves(runner.kv_pages))
    assert after["kv_cache_device_bytes"] == 32 * page_bytes


def test_structured_outputs_is_vllms_newer_name_for_guided_decoding():
    from jaxserve import GuidedDecodingParams, StructuredOutputsParams

    guide = StructuredOutputsParams(choice=["yes", "no"])
    assert SamplingParams(structured_outputs=guide).guided_decoding == GuidedDecodingParams(choice=("yes", "no"))
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=guide, guided_decoding=guide)


def test_logprobs_are_vllm_logprobs_with_ranks_and_decoded_tokens(llama_llm):
    """Each entry is a float that also has vLLM's .logprob / .rank / .decoded_token: the top entries ranked 1..k in
    order, the sampled (or prompt) token ranked among the whole vocabulary, greedy tokens first."""
    from jaxserve.host.request import Logprob

    prompt = expected("llama_gqa")["prompts"][5]["token_ids"]
    tokenizer = llama_llm.get_tokenizer()
    params = SamplingParams(max_tokens=12, temperature=3.0, seed=11, logprobs=3, prompt_logprobs=2)
    output = llama_llm.generate([prompt], params)[0]
    greedy = llama_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0))[0].outputs[0]
    assert all(lp[t].rank == 1 for t, lp in zip(greedy.token_ids, greedy.logprobs))
    completion = output.outputs[0]
    chosen = [
        *zip(prompt[1:], output.prompt_logprobs[1:], [2] * len(prompt)),
        *zip(completion.token_ids, completion.logprobs, [3] * 12),
    ]
    outside = 0
    for token, logprobs, num_top in chosen:
        assert all(isinstance(v, Logprob) and v.logprob == float(v) for v in logprobs.values())
        top = sorted((v for t, v in logprobs.items() if t != token or v.rank <= num_top), key=lambda v: v.rank)
        assert [v.rank for v in top] == list(range(1, num_top + 1))
        assert [v.logprob for v in top] == sorted((v.logprob for v in top), reverse=True)
        rank = logprobs[token].rank
        if rank > num_top:  # below the top: none of them is less likely than it
            outside += 1
            assert logprobs[token].logprob <= top[-1].logprob
        else:
            assert top[rank - 1] is logprobs[token]
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in logprobs.items())
    assert outside > 0, "temperature 3 samples some tokens outside the top 3"


def test_skip_special_tokens_false_keeps_them_in_the_text(llama_llm):
    tokenizer = llama_llm.get_tokenizer()
    eos = tokenizer.token_to_id("</s>")
    forced = dict(max_tokens=3, temperature=0.0, logit_bias={eos: 100}, ignore_eos=True)
    kept = llama_llm.generate([[1, 5, 9]], SamplingParams(**forced, skip_special_tokens=False))[0].outputs[0]
    skipped = llama_llm.generate([[1, 5, 9]], SamplingParams(**forced))[0].outputs[0]
    assert kept.token_ids == skipped.token_ids == [eos] * 3
    assert kept.text == tokenizer.decode([eos] * 3, skip_special_tokens=False) and "</s>" in kept.text
    # this vocabulary's decoder puts no space between special tokens: spaces_between_special_tokens changes nothing
    joined = llama_llm.generate(
        [[1, 5, 9]], SamplingParams(**forced, skip_special_tokens=False, spaces_between_special_tokens=False)
    )[0].outputs[0]
    assert eos in tokenizer.added_token_texts and joined.text == kept.text == "</s>" * 3
    ended = llama_llm.generate(
        [[1, 5, 9]], SamplingParams(**{**forced, "ignore_eos": False}, skip_special_tokens=False)
    )
    assert ended[0].outputs[0].token_ids == [eos] and ended[0].outputs[0].text == ""  # the ending EOS adds no text
    assert skipped.text == ""
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
        SamplingParams(skip_special_tokens="no")
