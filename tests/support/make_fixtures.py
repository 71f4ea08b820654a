"""Build the tiny Hugging Face checkpoints in tests/fixtures and record transformers' outputs on them.

Run once, when the fixtures need to change (needs torch and transformers: /tmp/hfvenv or the bench extras):

    python -m tests.support.make_fixtures              # every fixture, and the tokenizer
    python -m tests.support.make_fixtures qwen2 qwen3  # only these, leaving the others as they are
    python -m tests.support.make_fixtures yarn         # tests/fixtures/gpt_oss_yarn_frequencies.json
    python -m tests.support.make_fixtures --out /tmp/f llama_gqa  # elsewhere (to diff against the committed)

The fixtures themselves are listed per family in tests/support/fixture_configs/; each directory holds
config.json, model.safetensors, tokenizer.model and expected.json (tests/support/fixture_recording.py).
The suite itself never imports torch.
"""

from __future__ import annotations

import inspect
import os
import sys

import sentencepiece
import torch
import transformers

from tests.support.fixture_configs import MODELS
from tests.support.fixture_recording import (
    COMMON,
    TEXT_PROMPTS,
    VOCAB_SIZE,
    record_outputs,
    save_checkpoint,
    split_output_option,
    tokenizer_in,
)
from tests.support.yarn_frequencies import record_yarn

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


def train_tokenizer(tokenizer: str) -> None:
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
        model_prefix=tokenizer[: -len(".model")],
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
    os.remove(tokenizer[: -len(".model")] + ".vocab")


def build(name: str, model_type: str, overrides: dict, seed: int, out: str, tokenizer: str) -> None:
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
        for param_name, param in model.named_parameters():
            if param.dim() > 1 and not param_name.endswith("_bias"):  # GPT-OSS's experts' biases are [X, N]
                param.mul_(weight_scale)
            elif random_vectors:
                param.add_(0.3 * torch.randn_like(param))
    directory = os.path.join(out, name)
    save_checkpoint(model.to(getattr(torch, dtype)), directory, tokenizer)
    # Expectations are float32 math on the saved (possibly bf16-rounded) weights, loaded as a user would.
    loading = dict(attn_implementation=attention) if attention else {}
    model = model_class.from_pretrained(directory, dtype=torch.float32, **loading).eval()
    if force_long_rope:
        use_long_rope_factors(model)
    record_outputs(model, directory, tokenizer, seed, model_type, dtype)


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


def main() -> None:
    out, only = split_output_option(sys.argv[1:])
    if "yarn" in only:
        record_yarn(out)
        only = [name for name in only if name != "yarn"]
        if not only:
            return
    unknown = set(only) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown fixtures {sorted(unknown)}; known: {', '.join(MODELS)}")
    tokenizer = os.path.join(out, "tokenizer.model")
    if only:
        tokenizer = tokenizer_in(out)
    else:
        train_tokenizer(tokenizer)
    for name, (seed, model_type, overrides) in MODELS.items():
        if not only or name in only:
            build(name, model_type, dict(overrides), seed, out, tokenizer)
            print("built", name, file=sys.stderr)


if __name__ == "__main__":
    main()
