"""Build the tiny DeepSeek-V2 / V3 checkpoints in tests/fixtures/deepseek_* with transformers' own classes and
record their outputs, as make_fixtures.py does for the other families (its prompts, tokenizer and format).

    /tmp/hfvenv/bin/python -m tests.support.make_deepseek_fixtures            # all of them
    /tmp/hfvenv/bin/python -m tests.support.make_deepseek_fixtures deepseek_v3  # only these
    /tmp/hfvenv/bin/python -m tests.support.make_deepseek_fixtures --out /tmp/f  # elsewhere

Its own script because V3's e_score_correction_bias is a buffer, not a parameter: make_fixtures' build
leaves it at zero, and a bias read wrongly (or not at all) would not show. Routers get larger weights
than the rest so that routing is decided by margins far above float32 noise.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

from tests.support.fixture_recording import COMMON, record_outputs, save_checkpoint, split_output_option, tokenizer_in

ROUTER_SCALE = 6.0
WEIGHT_SCALE = 4.0
V2 = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
V3 = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
MODELS = {
    # V2-Lite-shaped: no q_lora_rank, softmax greedy top 2 of 8 experts, 2 shared experts, a dense first layer, tied
    "deepseek_v2_lite": (
        V2,
        dict(
            hidden_size=48,
            intermediate_size=56,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            q_lora_rank=None,
            kv_lora_rank=20,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            tie_word_embeddings=True,
        ),
    ),
    # V2 with q_lora_rank, biases, odd sizes (3 heads; transformers' V2 needs an even kv_lora_rank), group_limited_greedy (2 groups,
    # 1 kept), routed_scaling_factor, YaRN with mscale_all_dim changing the softmax scale
    "deepseek_v2_grouped": (
        V2,
        dict(
            hidden_size=48,
            intermediate_size=50,
            moe_intermediate_size=12,
            num_hidden_layers=3,
            num_attention_heads=3,
            q_lora_rank=24,
            kv_lora_rank=18,
            qk_nope_head_dim=10,
            qk_rope_head_dim=6,
            v_head_dim=9,
            attention_bias=True,
            n_routed_experts=12,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                mscale=0.707,
                mscale_all_dim=0.707,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # V3: sigmoid scores with a correction bias, 16 experts in 4 groups (2 kept) top 4, renormalized and scaled
    # by 2.5, a shared expert, interleaved rope, YaRN (mscale = mscale_all_dim)
    "deepseek_v3": (
        V3,
        dict(
            hidden_size=64,
            intermediate_size=72,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # Kimi-K2-shaped V3: one expert group, no renormalization, rope not interleaved, 2 dense layers of 4, an odd
    # entry (13 + 4 lanes, padded to 18 in the cache)
    "deepseek_v3_kimi": (
        V3,
        dict(
            hidden_size=40,
            intermediate_size=48,
            moe_intermediate_size=12,
            num_hidden_layers=4,
            num_attention_heads=2,
            q_lora_rank=20,
            kv_lora_rank=13,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=10,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.8,
            rope_interleave=False,
        ),
    ),
}


def build(name: str, classes, overrides: dict, seed: int, out: str, tokenizer: str) -> None:
    torch.manual_seed(seed)
    config_class, model_class = classes
    model = model_class(config_class(**{**COMMON, **overrides})).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() > 1:
                param.mul_(ROUTER_SCALE if param_name.endswith("mlp.gate.weight") else WEIGHT_SCALE)
            else:  # norm scales and biases perturbed, so that reading them wrongly shows
                param.add_(0.3 * torch.randn_like(param))
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    directory = os.path.join(out, name)
    save_checkpoint(model, directory, tokenizer)
    model = model_class.from_pretrained(directory, dtype=torch.float32).eval()
    record_outputs(model, directory, tokenizer, seed, model.config.model_type, "float32")


def main() -> None:
    out, only = split_output_option(sys.argv[1:])
    tokenizer = tokenizer_in(out)
    unknown = set(only) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown fixtures {sorted(unknown)}; known: {', '.join(MODELS)}")
    for seed, (name, (classes, overrides)) in enumerate(MODELS.items(), start=100):
        if not only or name in only:
            build(name, classes, dict(overrides), seed, out, tokenizer)
            print("built", name, file=sys.stderr)


if __name__ == "__main__":
    main()
