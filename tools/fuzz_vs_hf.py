"""Random Llama, Mixtral, Qwen2, Qwen3 and Qwen3-MoE configurations against transformers: greedy
tokens must be identical.

Each seed draws an architecture (the family; GQA/MQA/MHA, explicit head_dim, tied or untied
embeddings, rope theta, linear or llama3 rope scaling, attention/MLP biases, experts, top-k and
whether their weights are renormalized, sliding windows on every layer or from max_window_layers on,
odd vocabularies) and engine settings (page size, chunk budget, query block, attention implementation),
builds a random checkpoint with transformers, and compares 5 prompts x 20 greedy tokens. Prints a
JSON line per seed; the failing ones carry their configs. Needs the bench extras (torch, transformers):

    .venv/bin/python tools/fuzz_vs_hf.py --seeds 0:30
    .venv/bin/python tools/fuzz_vs_hf.py --seeds 0:10 --fake-devices 8 --tensor-parallel 2 --data-parallel 2 \
        --expert-parallel   # meshes on fake CPU devices; expert counts that divide the devices and ones that do not
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NUM_PROMPTS, NEW_TOKENS = 5, 20
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def random_config(rng, expert_parallel: bool = False) -> tuple[str, dict]:
    num_kv_heads = int(rng.choice([1, 2, 3, 4]))
    num_heads = num_kv_heads * int(rng.choice([1, 2, 3, 4]))
    config = dict(
        vocab_size=int(rng.choice([97, 256, 333, 512, 1000])),
        hidden_size=num_heads * int(rng.choice([4, 6, 8, 12, 16])),  # transformers wants heads | hidden
        intermediate_size=int(rng.choice([36, 64, 90, 128])),
        num_hidden_layers=int(rng.choice([1, 2, 3])),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=int(rng.choice([8, 12, 16, 20, 32])),
        rope_theta=float(rng.choice([1e4, 5e5, 1e6, 1234.5])),
        rms_norm_eps=float(rng.choice([1e-5, 1e-6])),
        tie_word_embeddings=bool(rng.random() < 0.4),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    scaling = rng.random()
    if scaling < 0.2:
        config["rope_scaling"] = dict(rope_type="linear", factor=2.0)
    elif scaling < 0.4:
        config["rope_scaling"] = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        )
    kind = str(rng.choice(["llama", "llama", "mixtral", "mixtral", "qwen2", "qwen3", "qwen3_moe"]))
    return kind, {**config, **FAMILY_DRAWS[kind](rng, config["num_hidden_layers"], expert_parallel)}


def _experts(rng, expert_parallel: bool, name: str) -> dict:
    # Spread over 4 or 8 devices: fewer experts than devices, counts that leave some devices one more
    # expert (Qwen2-MoE's 60 on 8), and counts that divide.
    num_experts = int(rng.choice([3, 5, 6, 7, 8, 10, 60] if expert_parallel else [2, 3, 4, 6, 8]))
    return {name: num_experts, "num_experts_per_tok": int(rng.integers(1, min(num_experts, 3) + 1))}


def _qwen_window(rng, num_layers: int) -> dict:
    """Windows are off unless use_sliding_window; then only layers from max_window_layers on slide."""
    return dict(
        use_sliding_window=bool(rng.random() < 0.5),
        sliding_window=int(rng.choice([8, 16, 40])),
        max_window_layers=int(rng.integers(0, num_layers + 1)),
    )


FAMILY_DRAWS = {
    "llama": lambda rng, layers, spread: dict(
        attention_bias=bool(rng.random() < 0.3), mlp_bias=bool(rng.random() < 0.2)
    ),
    "mixtral": lambda rng, layers, spread: {
        **_experts(rng, spread, "num_local_experts"),
        **({"sliding_window": int(rng.choice([8, 16, 40]))} if rng.random() < 0.3 else {}),
    },
    "qwen2": lambda rng, layers, spread: _qwen_window(rng, layers),
    "qwen3": lambda rng, layers, spread: dict(attention_bias=bool(rng.random() < 0.3), **_qwen_window(rng, layers)),
    "qwen3_moe": lambda rng, layers, spread: dict(
        **_experts(rng, spread, "num_experts"),
        moe_intermediate_size=int(rng.choice([24, 36, 64])),
        norm_topk_prob=bool(rng.random() < 0.5),
        attention_bias=bool(rng.random() < 0.3),
        use_sliding_window=bool(rng.random() < 0.3),
        sliding_window=int(rng.choice([8, 16, 40])),
    ),
}


def random_engine(rng) -> dict:
    query_block = int(rng.choice([4, 8, 16]))
    return dict(
        dtype="float32",
        max_model_len=160,
        max_num_seqs=int(rng.choice([2, 8])),
        max_num_batched_tokens=max(query_block, int(rng.choice([16, 32, 64]))),
        page_size=int(rng.choice([4, 8, 16])),
        prefill_query_block=query_block,
        attention_impl=str(rng.choice(["auto", "reference", "pallas"])),
        show_progress=False,
    )


def run(seed: int, mesh: dict) -> dict:
    import torch
    import transformers

    from jaxserve import LLM, SamplingParams

    rng = np.random.default_rng(seed)
    kind, config_dict = random_config(rng, mesh["enable_expert_parallel"])
    torch.manual_seed(seed)
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[kind])
    config = config_class(**config_dict)
    config.initializer_range = 0.2  # larger weights: less flat distributions, more varied tokens
    config._experts_implementation = "eager"  # transformers' grouped_mm wants 16-byte strides
    model = model_class(config).eval()
    with torch.no_grad():  # biases start at zero and norm scales at one: perturbed, reading them wrongly shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param))
    directory = tempfile.mkdtemp()
    model.save_pretrained(directory)
    prompts = [
        [1] + rng.integers(3, config_dict["vocab_size"], size=int(n)).tolist()
        for n in rng.integers(1, 90, size=NUM_PROMPTS)
    ]
    expected = [
        model.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    engine = {**random_engine(rng), **mesh}
    outputs = LLM(directory, **engine).generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    equal = sum(o.outputs[0].token_ids == e for o, e in zip(outputs, expected))
    record = dict(seed=seed, kind=kind, equal=equal, of=len(prompts))
    num_experts = config_dict.get("num_local_experts", config_dict.get("num_experts"))
    if num_experts:
        record["num_experts"] = num_experts
    if equal < len(prompts):
        record.update(config=config_dict, engine=engine)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:20", help="first:last (exclusive)")
    parser.add_argument("--fake-devices", type=int, default=0, help="CPU devices to simulate (before JAX starts)")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--expert-parallel", action="store_true")
    args = parser.parse_args()
    if args.fake_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.fake_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    mesh = dict(
        tensor_parallel_size=args.tensor_parallel,
        data_parallel_size=args.data_parallel,
        enable_expert_parallel=args.expert_parallel,
    )
    first, last = map(int, args.seeds.split(":"))
    failures = 0
    for seed in range(first, last):
        try:
            record = run(seed, mesh)
        except Exception as error:  # report and go on: one broken draw should not hide the others
            record = dict(seed=seed, error=f"{type(error).__name__}: {error}"[:500])
        failures += "error" in record or record["equal"] < record["of"]
        print(json.dumps(record), flush=True)
    print(json.dumps(dict(seeds=last - first, failures=failures)))


if __name__ == "__main__":
    main()
