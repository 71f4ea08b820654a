"""A draft model's KV pool takes the target's cache.kv_dtype (issue 25 with issue 26): its pages are as small as
the target's, a self-draft still copies the target's pages of a prompt instead of prefilling it (the pools are
alike, scales included), and outputs are those of the same engine without speculation; a draft whose own dtype
cannot take the cache type keeps its own."""

import json
import shutil

import jax
import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels.paged_attention.kv_quantization import QuantizedPages
from tests.engine.test_speculative import ENGINE, assert_logprobs_equal, summary, workload
from tests.engine.test_speculative_draft import SELF_INT8, assert_draft_holds_nothing
from tests.support.fixtures import fixture_dir


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_a_self_draft_keeps_its_kv_in_the_targets_cache_dtype(kv_dtype):
    plain = LLM(fixture_dir("llama_gqa"), **ENGINE, kv_dtype=kv_dtype)
    speculating = LLM(fixture_dir("llama_gqa"), **ENGINE, kv_dtype=kv_dtype, speculative=SELF_INT8)
    draft_pages = speculating.engine.speculation.proposer.runner.kv_pages
    target_pages = speculating.engine.runner.kv_pages
    if kv_dtype == "int8":
        assert all(isinstance(pool, QuantizedPages) for pool in draft_pages.keys + draft_pages.values)
    else:
        assert {pool.dtype for pool in draft_pages.keys + draft_pages.values} == {jnp.dtype(kv_dtype)}
    assert jax.tree.structure(draft_pages) == jax.tree.structure(target_pages)

    prompts, params = workload(2, 12)
    results = {name: llm.generate(prompts, params) for name, llm in (("plain", plain), ("draft", speculating))}
    assert summary(results["draft"]) == summary(results["plain"])
    assert_logprobs_equal(results["draft"], results["plain"])
    stats = speculating.stats()
    assert stats["speculative_num_accepted_tokens"] > 0
    assert stats["speculative_draft_copied_pages"] > 0  # the target's pages of a prompt, taken as they are
    assert_draft_holds_nothing(speculating)

    long_prompt = list(range(3, 40))  # whole pages of prompt: the draft takes them instead of prefilling
    before = speculating.stats()["speculative_draft_prefill_steps"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = plain.generate([long_prompt], greedy)[0].outputs[0].token_ids
    assert speculating.generate([long_prompt], greedy)[0].outputs[0].token_ids == expected
    assert speculating.stats()["speculative_draft_prefill_steps"] == before


def test_a_draft_whose_dtype_cannot_take_the_cache_type_keeps_its_own(tmp_path, monkeypatch):
    """A float32 target's cache in bfloat16 beside a float16 draft checkpoint (dtype auto): the draft's pool stays in
    float16 (its own 16-bit type: a bfloat16 one would not halve it), the draft prefills instead of copying pages,
    outputs are the same engine's without speculation; the pool's bytes are what the budget counted."""
    from jaxserve.engine import draft_model

    counted = []
    page_bytes = draft_model.draft_device_page_bytes

    def counting(draft, config, mesh):
        counted.append(page_bytes(draft, config, mesh))
        return counted[-1]

    monkeypatch.setattr(draft_model, "draft_device_page_bytes", counting)
    monkeypatch.setattr("jaxserve.engine.kv_budget.draft_device_page_bytes", counting)
    draft = tmp_path / "draft_f16"
    shutil.copytree(fixture_dir("llama_mqa_odd"), draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    engine = {**ENGINE, "dtype": "auto", "kv_dtype": "bfloat16"}
    speculative = {
        "method": "draft",
        "draft_model": str(draft),
        "num_speculative_tokens": 3,
        "speculative_adaptive": False,
    }
    plain = LLM(fixture_dir("llama_gqa"), **engine)
    speculating = LLM(fixture_dir("llama_gqa"), **engine, speculative=speculative)
    draft_pages = speculating.engine.speculation.proposer.runner.kv_pages
    assert {pool.dtype for pool in draft_pages.keys + draft_pages.values} == {jnp.dtype("float16")}
    num_pages = draft_pages.keys[0].shape[0]
    assert set(counted) == {sum(leaf.nbytes for leaf in jax.tree.leaves(draft_pages)) // num_pages}

    prompts, params = workload(3, 8)
    assert summary(speculating.generate(prompts, params)) == summary(plain.generate(prompts, params))
    stats = speculating.stats()
    assert stats["speculative_draft_copied_pages"] == 0 and stats["speculative_draft_prefill_steps"] > 0
    assert_draft_holds_nothing(speculating)
