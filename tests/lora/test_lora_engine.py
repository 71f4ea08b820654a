"""Multi-LoRA serving against PEFT: each adapter's greedy tokens equal PeftModel's on the same base, alone
and mixed in one batch with the base model and the other adapters; loads and unloads while serving compile
nothing; the prefix cache keeps adapters' pages apart; bad adapters and names are refused clearly and the
engine keeps serving. The engine speculates (n-gram proposals verified in their own executable, which must
apply each row's adapter as plain steps do), and is built through the offline API's lora_adapters."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.lora.adapter import read_adapter
from tests.lora.support import ADAPTER_NAMES, BASE_MODEL, LORA_ENGINE, adapter_dir, expected, lora_pair, write_adapter

PROMPTS = expected()["prompts"]
MAX_TOKENS = len(expected()["base_greedy_token_ids"][0])


def want(adapter: str | None, prompt_index: int) -> list[int]:
    if adapter is None:
        return expected()["base_greedy_token_ids"][prompt_index]
    return expected()["greedy_token_ids"][adapter][prompt_index]


def greedy(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=adapter)


@pytest.fixture(scope="module")
def llm():
    engine = {name: value for name, value in LORA_ENGINE.items() if name != "lora"}
    return LLM(
        BASE_MODEL,
        lora_adapters=LORA_ENGINE["lora"]["adapters"],
        max_adapters=LORA_ENGINE["lora"]["max_adapters"],
        max_rank=LORA_ENGINE["lora"]["max_rank"],
        speculative=dict(method="ngram", num_speculative_tokens=3, speculative_adaptive=False),
        **engine,
    )


def generate(llm, cases: list[tuple[str | None, int]]) -> list[list[int]]:
    outputs = llm.generate([PROMPTS[index] for _, index in cases], [greedy(adapter) for adapter, _ in cases])
    return [output.outputs[0].token_ids for output in outputs]


def test_adapters_change_the_outputs():
    """The fixtures are meaningful: every adapter moves the greedy tokens away from the base model's."""
    for adapter in ADAPTER_NAMES:
        assert sum(want(adapter, i) != want(None, i) for i in range(len(PROMPTS))) >= len(PROMPTS) - 1


def test_each_adapter_alone_matches_peft(llm):
    for adapter in ADAPTER_NAMES:
        cases = [(adapter, index) for index in (0, 3)]
        assert generate(llm, cases) == [want(*case) for case in cases], adapter


def test_mixed_batch_matches_peft(llm):
    """Every prompt under the base model and each adapter, interleaved, in batches of mixed adapters."""
    cases = [(adapter, index) for index in range(len(PROMPTS)) for adapter in (None, *ADAPTER_NAMES)]
    assert generate(llm, cases) == [want(*case) for case in cases]
    assert llm.stats()["num_compiles_after_warmup"] == 0


def test_generate_lora_argument(llm):
    """generate(lora=...) applies to the prompts whose params name no adapter; the params' own wins."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=name) for name in (None, "mixed_r3")]
    outputs = llm.generate([PROMPTS[2], PROMPTS[2]], params, lora="mlp_r8_rslora")
    assert [o.outputs[0].token_ids for o in outputs] == [want("mlp_r8_rslora", 2), want("mixed_r3", 2)]
    assert llm.stats()["speculative_num_verify_rows"] > 0  # verify steps ran adapter rows


def test_load_and_unload_while_serving_compile_nothing(llm):
    engine = llm.engine
    engine.unload_lora("mixed_r3")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'mixed_r3'"):
        llm.generate(PROMPTS[0], greedy("mixed_r3"))
    engine.load_lora("mixed_again", adapter_dir("mixed_r3"))  # into another slot than before
    engine.load_lora("attn_twice", adapter_dir("attn_r4"))
    cases = [("mixed_again", 1), ("attn_twice", 2), (None, 1), ("attn_r4", 2)]
    outputs = llm.generate([PROMPTS[i] for _, i in cases], [greedy(a) for a, _ in cases])
    expected_tokens = [want("mixed_r3", 1), want("attn_r4", 2), want(None, 1), want("attn_r4", 2)]
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens
    engine.unload_lora("attn_twice")
    engine.unload_lora("mixed_again")
    engine.load_lora("mixed_r3", adapter_dir("mixed_r3"))
    assert generate(llm, [("mixed_r3", 4)]) == [want("mixed_r3", 4)]
    assert llm.stats()["num_compiles_after_warmup"] == 0
    assert [a["name"] for a in engine.lora_adapters()] == sorted(
        engine.parts.lora.adapters, key=lambda n: engine.parts.lora.adapters[n].slot
    )


def test_prefix_cache_keeps_adapters_apart(llm):
    """A long prompt cached under the base model is recomputed (not reused) under an adapter, and the
    adapter's own pages serve its next request."""
    index = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    assert len(PROMPTS[index]) > 32  # two full pages at least (page_size 16)
    assert llm.engine.reset_prefix_cache()
    base = llm.generate(PROMPTS[index], greedy(None))[0]
    first = llm.generate(PROMPTS[index], greedy("attn_r4"))[0]
    again = llm.generate(PROMPTS[index], greedy("attn_r4"))[0]
    other = llm.generate(PROMPTS[index], greedy("mlp_r8_rslora"))[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32
    assert base.outputs[0].token_ids == want(None, index)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want("attn_r4", index)
    assert other.outputs[0].token_ids == want("mlp_r8_rslora", index)


def _check_still_serves(llm):
    assert generate(llm, [("attn_r4", 0), (None, 0)]) == [want("attn_r4", 0), want(None, 0)]


@pytest.mark.parametrize(
    "tensors, config, message",
    [
        (lora_pair("layers.0.self_attn.q_proj", 32, 64, 4), {}, "another base model"),  # hidden 32, not 64
        (lora_pair("layers.5.self_attn.q_proj", 64, 64, 4), {}, "another base model"),  # no layer 5
        (lora_pair("layers.0.mlp.gate_proj", 64, 96, 16), {"r": 16}, "above the slot rank 8"),
        (lora_pair("layers.0.self_attn.rotary", 64, 64, 4), {}, "targets rotary"),
        (lora_pair("layers.0.mlp.experts.1.gate_proj", 64, 96, 4), {}, "routed experts"),
        (
            {
                "base_model.model.lm_head.lora_A.weight": lora_pair("x", 64, 4, 4)[
                    "base_model.model.model.x.lora_A.weight"
                ]
            },
            {},
            "unsupported tensor",
        ),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"use_dora": True}, "DoRA"),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"modules_to_save": ["lm_head"]}, "fully trained modules"),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"lora_alpha": None}, "lora_alpha must be a number"),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"lora_alpha": "16"}, "lora_alpha must be a number"),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"r": 0}, "r must be a positive integer"),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"alpha_pattern": ["q_proj"]}, "alpha_pattern must map"),
        (lora_pair("layers.0.self_attn.q_proj", 64, 64, 4), {"alpha_pattern": {"q_proj(": 4}}, "not a regular expr"),
    ],
    ids=["shapes", "layers", "rank", "target", "experts", "lm_head", "dora", "modules_to_save"]
    + ["alpha_null", "alpha_string", "r_zero", "pattern_list", "pattern_regex"],
)
def test_bad_adapters_are_refused(llm, tmp_path, tensors, config, message):
    path = write_adapter(str(tmp_path / "adapter"), tensors, **config)
    before = dict(llm.engine.parts.lora.adapters)
    with pytest.raises(ValueError, match=message):
        llm.engine.load_lora("bad", path)
    assert llm.engine.parts.lora.adapters == before
    _check_still_serves(llm)


@pytest.mark.parametrize("broken", ["config_list", "weights_cut", "weights_garbage"])
def test_malformed_adapter_files_are_refused_by_name(llm, tmp_path, broken):
    path = write_adapter(str(tmp_path / "adapter"), lora_pair("layers.0.self_attn.q_proj", 64, 64, 4))
    target = os.path.join(path, "adapter_config.json" if broken == "config_list" else "adapter_model.safetensors")
    with open(target, "rb") as f:
        content = f.read()
    replaced = {"config_list": b"[1, 2]", "weights_cut": content[: len(content) // 2], "weights_garbage": b"\xff" * 64}
    with open(target, "wb") as f:
        f.write(replaced[broken])
    with pytest.raises(ValueError, match="not an object" if broken == "config_list" else "cannot read"):
        llm.engine.load_lora("bad", path)
    _check_still_serves(llm)


def test_rank_and_alpha_patterns_match_as_peft_matches_them(tmp_path):
    """peft.utils.other.get_pattern_key: a key matches the end of the module's name in the model
    ("model.layers.0..."), as a group of its own (an alternation matches either whole)."""
    tensors = {**lora_pair("layers.0.self_attn.q_proj", 8, 8, 4), **lora_pair("layers.1.self_attn.v_proj", 8, 8, 4)}
    for pattern, scaled in (
        ({"model.layers.1.self_attn.v_proj": 32}, {"layers.1.self_attn.v_proj"}),
        ({"q_proj|v_proj": 32}, {"layers.0.self_attn.q_proj", "layers.1.self_attn.v_proj"}),
        ({"layers.0.self_attn.q_proj": 32}, {"layers.0.self_attn.q_proj"}),
        ({"proj": 32}, set()),  # matches no name's end on a "." boundary
    ):
        path = write_adapter(str(tmp_path / str(len(os.listdir(tmp_path)))), tensors, alpha_pattern=pattern)
        adapter = read_adapter(path)
        for module, projection in adapter.projections.items():
            b = tensors[f"base_model.model.model.{module}.lora_B.weight"].T
            np.testing.assert_allclose(projection.b, b * (32 if module in scaled else 8) / 4, rtol=1e-6)


def test_bad_names_and_full_slots_are_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate(PROMPTS[0], greedy("nope"))
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter directory"):
        llm.engine.load_lora("missing", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="already loaded"):
        llm.engine.load_lora("attn_r4", adapter_dir("attn_r4"))
    extra = []
    for i in range(len(llm.engine.parts.lora.adapters), 8):
        extra.append(f"extra{i}")
        llm.engine.load_lora(extra[-1], adapter_dir("attn_r4"))
    with pytest.raises(ValueError, match="all 8 LoRA adapter slots are in use"):
        llm.engine.load_lora("one_too_many", adapter_dir("attn_r4"))
    assert generate(llm, [(extra[-1], 0)]) == [want("attn_r4", 0)]
    for name in extra:
        llm.engine.unload_lora(name)
    _check_still_serves(llm)
    assert llm.stats()["num_compiles_after_warmup"] == 0


def test_in_use_adapter_is_not_unloaded(llm):
    llm.engine.add_request("busy", PROMPTS[0], greedy("attn_r4"))
    with pytest.raises(ValueError, match="in use by 1 unfinished requests"):
        llm.engine.unload_lora("attn_r4")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert "attn_r4" in llm.engine.parts.lora.adapters


def test_engine_without_slots_refuses_adapters(llama_llm):
    with pytest.raises(ValueError, match="serves none"):
        llama_llm.generate(PROMPTS[0], greedy("attn_r4"))
    with pytest.raises(ValueError, match="no LoRA slots"):
        llama_llm.engine.load_lora("a", adapter_dir("attn_r4"))


def test_fixture_adapters_are_peft_files():
    for name in ADAPTER_NAMES:
        assert sorted(os.listdir(adapter_dir(name))) == ["adapter_config.json", "adapter_model.safetensors"]


def test_handed_over_sequences_carry_their_adapter(llm):
    """A decode replica admits handed-over requests through new_sequence: the adapter comes with them."""
    engine = llm.engine
    seq = engine.new_sequence("handed", PROMPTS[0], greedy("mixed_r3"), sampling_seed=0)
    loaded = engine.parts.lora.adapters["mixed_r3"]
    assert (seq.lora_slot, seq.cache_root_key) == (loaded.slot, loaded.identity) and loaded.slot > 0
    assert engine.new_sequence("plain", PROMPTS[0], greedy(None), sampling_seed=0).lora_slot == 0
    with pytest.raises(ValueError, match="unknown LoRA adapter 'elsewhere'"):
        engine.new_sequence("missing", PROMPTS[0], greedy("elsewhere"), sampling_seed=0)


def test_vllm_lora_requests_load_on_first_use_and_take_the_least_recently_used_slot():
    """vLLM's offline LoRA code as it is written: enable_lora / max_loras / max_lora_rank and a LoRARequest per
    call. Two slots for three adapters: the third's first use unloads the least recently used."""
    from jaxserve import LoRARequest

    engine = {name: value for name, value in LORA_ENGINE.items() if name != "lora"}
    vllm_llm = LLM(BASE_MODEL, enable_lora=True, max_loras=2, max_lora_rank=8, **engine)
    requests = {name: LoRARequest(name, number + 1, adapter_dir(name)) for number, name in enumerate(ADAPTER_NAMES)}
    first, second, third = ADAPTER_NAMES

    def run(names, index=1):
        lora = [requests[name] if name else None for name in names]
        outputs = vllm_llm.generate([PROMPTS[index]] * len(names), greedy(None), lora_request=lora)
        assert [o.outputs[0].token_ids for o in outputs] == [want(name, index) for name in names]

    run([first, None, second])
    assert sorted(vllm_llm.engine.parts.lora.adapters) == sorted([first, second])
    run([first])  # second is now the least recently used
    vllm_llm.generate(PROMPTS[2], greedy(None), lora_request=requests[third])
    assert sorted(vllm_llm.engine.parts.lora.adapters) == sorted([first, third])
    run([second, third], index=0)  # first goes
    with pytest.raises(ValueError, match="3 LoRA adapters at once, more than the engine's 2 slots"):
        run([first, second, third])
    with pytest.raises(ValueError, match="already loaded from"):
        vllm_llm.generate(PROMPTS[0], greedy(None), lora_request=LoRARequest(second, 9, adapter_dir(first)))
    with pytest.raises(ValueError, match="not both"):
        vllm_llm.generate(PROMPTS[0], greedy(None), lora="x", lora_request=requests[first])
    vllm_llm.unload_lora(second)  # by hand: no longer the requests' to evict
    run([first], index=2)  # into the freed slot
    run([third, None], index=2)  # both slots full: third is loaded, first goes
    assert sorted(vllm_llm.engine.parts.lora.adapters) == sorted([first, third])
    assert vllm_llm.stats()["num_compiles_after_warmup"] == 0
