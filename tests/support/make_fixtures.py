"""Build the tiny Hugging Face checkpoints in tests/fixtures and record transformers' outputs on them.

Run once, when the fixtures need to change (needs the bench extras: torch and transformers):

    .venv/bin/python tests/support/make_fixtures.py            # every fixture, and the tokenizer
    .venv/bin/python tests/support/make_fixtures.py qwen2 qwen3  # only these, leaving the others as they are

Each fixture directory holds config.json, model.safetensors, tokenizer.model and expected.json:
the prompts (as token ids, plus the text they came from), transformers' greedy continuation and the
log-probabilities of the first generated position. The suite itself never imports torch.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys

import numpy as np
import sentencepiece
import torch
import transformers

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
TOKENIZER = os.path.join(FIXTURES, "tokenizer.model")
VOCAB_SIZE = 384
MAX_NEW_TOKENS = 24
NUM_TOP_LOGPROBS = 8

TEXT_PROMPTS = [
    "def forward(self, x):",
    "The quick brown fox jumps over the lazy dog.",
    "Return a new dictionary",
]
TOKEN_PROMPT_LENGTHS = [1, 5, 17, 40, 70]

COMMON = dict(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
MODELS = {
    "llama_gqa": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "llama_mha_tied": (
        "llama",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "llama_mqa_odd": (
        "llama",
        dict(
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=12,
            attention_bias=True,
            rope_theta=70000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_bf16": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            torch_dtype="bfloat16",
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_theta=1e6,
        ),
    ),
    "mixtral_top1_tied": (
        "mixtral",
        dict(
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=3,
            num_experts_per_tok=1,
            tie_word_embeddings=True,
        ),
    ),
    # eight experts: enough to spread one per device over 8 devices
    "mixtral_8x": (
        "mixtral",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    # q/k/v biases without an o_proj bias; only layers from max_window_layers on slide their window
    "qwen2": (
        "qwen2",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1e6,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            random_vectors=True,
            weight_scale=10.0,
        ),
    ),
    # per-head q/k norms; head_dim 16 is not hidden_size / heads
    "qwen3": (
        "qwen3",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=1e6,
            random_vectors=True,
        ),
    ),
    # experts' own MLP width; router weights not renormalized (norm_topk_prob false)
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            random_vectors=True,
        ),
    ),
    # six experts do not divide 4 devices (they hold 2, 2, 1, 1) nor 8 (two hold none)
    "mixtral_6x": (
        "mixtral",
        dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
        ),
    ),
    # Qwen2-MoE's 60 experts, top 4, not renormalized: over 8 devices, four hold 8 and four hold 7
    "qwen3_moe_60x": (
        "qwen3_moe",
        dict(
            hidden_size=16,
            intermediate_size=32,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            random_vectors=True,
        ),
    ),
    # Gemma 2: sliding and global layers alternate (the window, 8, is shorter than most prompts), scores
    # and final logits soft-capped low enough to bend them, query_pre_attn_scalar not head_dim, GQA, tied
    "gemma2": (
        "gemma2",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=8.0,
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # odd sizes, multi-head (no GQA), untied head, transformers' default caps, a 16-token window
    "gemma2_mha_untied": (
        "gemma2",
        dict(
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=5,
            head_dim=12,
            query_pre_attn_scalar=12,
            sliding_window=16,
            tie_word_embeddings=False,
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # Gemma 3: 5 local layers (rope base 10k, window 10) to 1 global (1M, linear scaling x8), then a local
    # one; per-head (1 + weight) q/k norms; multi-query attention
    "gemma3": (
        "gemma3_text",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=10,
            sliding_window_pattern=6,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # odd sizes, layer types listed, untied, a final logit cap, scores scaled by a scalar not head_dim
    "gemma3_odd_untied": (
        "gemma3_text",
        dict(
            hidden_size=36,
            intermediate_size=60,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=10,
            query_pre_attn_scalar=30,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
            final_logit_softcapping=6.0,
            rope_theta=50_000.0,
            rope_local_base_freq=5_000.0,
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # Phi-3 mini's shape: fused qkv_proj / gate_up_proj, multi-head, a sliding window on every layer
    "phi3": (
        "phi3",
        dict(
            pad_token_id=0,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=12,
            random_vectors=True,
        ),
    ),
    # Phi-3.5 / Phi-4-mini's rope: LongRoPE over 3/4 of each head (partial_rotary_factor), GQA 3:1, tied. The
    # engine's max_model_len (128) is within the pretraining length (256): short factors, and cos / sin
    # scaled for max_position_embeddings 1024
    "phi3_longrope_short": (
        "phi3",
        dict(
            pad_token_id=0,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            partial_rotary_factor=0.75,
            rope_scaling=dict(
                type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0], long_factor=[2, 3, 5, 8, 13, 21]
            ),
            tie_word_embeddings=True,
            random_vectors=True,
        ),
    ),
    # max_model_len (128) beyond the pretraining length (32): long factors for every position, chosen once;
    # transformers is recorded with its long factors forced (force_long_rope), as the engine serves them
    "phi3_longrope_long": (
        "phi3",
        dict(
            pad_token_id=0,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            original_max_position_embeddings=32,
            rope_scaling=dict(
                type="su",
                short_factor=[1.0, 1.1, 1.3, 1.6],
                long_factor=[1.0, 3.0, 7.0, 15.0],
                original_max_position_embeddings=32,
            ),
            random_vectors=True,
            force_long_rope=True,
        ),
    ),
    # Qwen2-MoE: a shared expert of its own width behind a sigmoid gate, five experts (odd under EP), top 2
    # not renormalized, q/k/v biases, and a dense MLP in the middle layer (mlp_only_layers)
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            hidden_size=36,
            intermediate_size=52,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=44,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            random_vectors=True,
        ),
    ),
    # GPT-OSS: sinks, sliding (short windows, so that they matter here) and full layers, biases everywhere,
    # YaRN; GQA with an odd head dim and a clamp low enough to bite; MHA tied with transformers' default rope;
    # six experts (uneven under EP 4) with a truncated YaRN and a sliding-heavy pattern
    "gpt_oss": (
        "gpt_oss",
        dict(
            hidden_size=40,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=10,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.3,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=8.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=32,
            ),
            initializer_range=0.1,
            random_vectors=True,
        ),
    ),
    "gpt_oss_mha_tied": (
        "gpt_oss",
        dict(
            hidden_size=32,
            intermediate_size=20,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["full_attention", "sliding_attention"],
            tie_word_embeddings=True,
            initializer_range=0.1,
            random_vectors=True,
        ),
    ),
    "gpt_oss_6x": (
        "gpt_oss",
        dict(
            hidden_size=48,
            intermediate_size=28,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                rope_type="yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=48, truncate=True
            ),
            initializer_range=0.1,
            random_vectors=True,
        ),
    ),
    # Qwen3-30B-A3B's structure at a tenth of its width and two layers: 128 experts top 8 renormalized
    # (norm_topk_prob), GQA 32:4, head_dim 128 independent of (and wider than) hidden / heads; bf16 on disk
    # to keep the file small (the expectations are float32 math on the rounded weights)
    "qwen3_moe_30b_a3b_shape": (
        "qwen3_moe",
        dict(
            hidden_size=32,
            intermediate_size=96,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            torch_dtype="bfloat16",
        ),
    ),
}
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
}


def train_tokenizer() -> None:
    """A small byte-fallback BPE over Python's own docstrings: real text, reproducible, no download."""
    import collections  # noqa: E401
    import functools
    import itertools
    import json as json_module
    import re
    import string

    corpus = []
    for module in (collections, functools, itertools, json_module, re, string, inspect, os):
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc:
                corpus.extend(line for line in doc.splitlines() if line.strip())
    corpus.extend(TEXT_PROMPTS)
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(corpus),
        model_prefix=TOKENIZER[: -len(".model")],
        vocab_size=VOCAB_SIZE,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    os.remove(TOKENIZER[: -len(".model")] + ".vocab")


def token_prompts(rng: np.random.Generator) -> list[list[int]]:
    return [[1] + rng.integers(3, VOCAB_SIZE, size=n - 1).tolist() for n in TOKEN_PROMPT_LENGTHS]


def build(name: str, model_type: str, overrides: dict, seed: int) -> None:
    directory = os.path.join(FIXTURES, name)
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(seed)
    dtype = overrides.pop("torch_dtype", "float32")
    random_vectors = overrides.pop("random_vectors", False)
    weight_scale = overrides.pop("weight_scale", 4.0)
    attention = overrides.pop("attn_implementation", None)  # Gemma 2's soft-cap: eager attention only
    force_long_rope = overrides.pop("force_long_rope", False)
    config_class, model_class = HF_CLASSES[model_type]
    config = config_class(**{**COMMON, **overrides})
    model = model_class(config).eval()
    # Larger-than-default weights make the tiny random models' distributions less flat, so greedy
    # decoding is decided by margins far above float32 noise. Biases start at zero and norm scales at
    # one: random_vectors perturbs them, so that reading them wrongly shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and not name.endswith("_bias"):  # GPT-OSS's experts' biases are [X, N]
                param.mul_(weight_scale)
            elif random_vectors:
                param.add_(0.3 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    shutil.copy(TOKENIZER, os.path.join(directory, "tokenizer.model"))
    # Expectations are float32 math on the saved (possibly bf16-rounded) weights, loaded as a user would.
    loading = dict(attn_implementation=attention) if attention else {}
    model = model_class.from_pretrained(directory, dtype=torch.float32, **loading).eval()
    if force_long_rope:
        use_long_rope_factors(model)

    processor = sentencepiece.SentencePieceProcessor(model_file=TOKENIZER)
    prompts = [dict(text=text, token_ids=[1] + processor.EncodeAsIds(text)) for text in TEXT_PROMPTS]
    prompts += [dict(text=None, token_ids=ids) for ids in token_prompts(np.random.default_rng(seed))]
    for prompt in prompts:
        input_ids = torch.tensor([prompt["token_ids"]])
        with torch.no_grad():
            logits = model(input_ids).logits[0, -1].float()
            generated = model.generate(
                input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, NUM_TOP_LOGPROBS)
        prompt["greedy_token_ids"] = generated[0, input_ids.shape[1] :].tolist()
        prompt["first_top_token_ids"] = top.indices.tolist()
        prompt["first_top_logprobs"] = top.values.tolist()
    with open(os.path.join(directory, "expected.json"), "w") as f:
        json.dump(
            dict(model_type=model_type, dtype=dtype, transformers_version=transformers.__version__, prompts=prompts),
            f,
            indent=1,
        )


def use_long_rope_factors(model) -> None:
    """LongRoPE's long factors at every length, as an engine whose max_model_len exceeds the pretraining
    length serves them (transformers switches per forward pass, by its longest position)."""
    rotary = model.model.rotary_emb
    original = model.config.rope_parameters["original_max_position_embeddings"]
    long_inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"](
        model.config, None, seq_len=original + 1
    )
    rotary.inv_freq.copy_(long_inv_freq)
    rotary.original_inv_freq.copy_(long_inv_freq)


# YaRN configs as checkpoints write them (GPT-OSS; DeepSeek-V3 and V2-Lite with mscale; Qwen-style partial rotary;
# an odd head with a short pretraining length, so the ramp spans several lanes), keyed by a name
YARN_CASES = {
    "gpt_oss": dict(
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
    "deepseek_v3": dict(
        head_dim=64,
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
    ),
    "deepseek_v2_lite": dict(
        head_dim=64,
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            mscale=0.707,
            mscale_all_dim=0.707,
            original_max_position_embeddings=4096,
        ),
    ),
    "partial_rotary": dict(
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e6,
            factor=4.0,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=32768,
        ),
    ),
    "odd_short": dict(
        head_dim=12,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=8.0, beta_fast=8, beta_slow=2),
    ),
}
YARN_FILE = os.path.join(FIXTURES, "gpt_oss_yarn_frequencies.json")


def record_yarn() -> None:
    """transformers' YaRN inverse frequencies and attention factor for each of YARN_CASES."""
    records = {}
    for name, overrides in YARN_CASES.items():
        hf = dict(
            model_type="llama",
            vocab_size=8,
            hidden_size=64,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            **json.loads(json.dumps(overrides)),
        )
        config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
        inv_freq, attention_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, None)
        records[name] = dict(config=hf, inv_freq=inv_freq.tolist(), attention_factor=float(attention_factor))
    with open(YARN_FILE, "w") as f:
        json.dump(dict(transformers_version=transformers.__version__, cases=records), f, indent=1)


def main() -> None:
    only = sys.argv[1:]
    if "yarn" in only:
        record_yarn()
        only = [name for name in only if name != "yarn"]
        if not only:
            return
    unknown = set(only) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown fixtures {sorted(unknown)}; known: {', '.join(MODELS)}")
    os.makedirs(FIXTURES, exist_ok=True)
    if not only:
        train_tokenizer()
    for seed, (name, (model_type, overrides)) in enumerate(MODELS.items()):  # a fixture's seed is its position
        if not only or name in only:
            build(name, model_type, dict(overrides), seed)
            print("built", name, file=sys.stderr)


if __name__ == "__main__":
    main()
