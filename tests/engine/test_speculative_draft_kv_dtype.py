"""A draft model's KV pool takes the target's cache.kv_dtype (issue 25 with issue 26): its pages are as small as
the target's, a self-draft still copies the target's pages of a prompt instead of prefilling it (the pools are
alike, scales included), and outputs are those of the same engine without speculation; a draft whose own dtype
cannot take the cache type is refused at start, naming the draft."""

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


def test_a_draft_whose_dtype_cannot_take_the_cache_type_is_refused_by_name(tmp_path):
    """A float32 target's cache in bfloat16 beside a float16 draft checkpoint (dtype auto): the draft's own cache is
    16-bit already, as the target's refusal says of a 16-bit target."""
    draft = tmp_path / "draft_f16"
    shutil.copytree(fixture_dir("llama_mqa_odd"), draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    target = tmp_path / "target"
    shutil.copytree(fixture_dir("llama_gqa"), target)
    speculative = {"method": "draft", "draft_model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(
        ValueError, match=r"speculative draft .*draft_f16.*kv_dtype='bfloat16' with model dtype float16"
    ):
        LLM(str(target), **{**ENGINE, "dtype": "auto", "kv_dtype": "bfloat16"}, speculative=speculative)
