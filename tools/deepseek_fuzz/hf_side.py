"""Random DeepSeek-V2 / V3 checkpoint by transformers (one venv with torch), for jax_side.py (jaxserve's venv).

    /tmp/hfvenv/bin/python tools/deepseek_fuzz/hf_side.py SEED DIR   # writes DIR (checkpoint + fuzz.json)
    .venv/bin/python tools/deepseek_fuzz/jax_side.py SEED DIR        # prints {"equal": n, "of": 4}

Draws V2 or V3, heads, q_lora_rank or none, kv_lora_rank (odd on V3), rope dims, expert groups and top k,
shared experts (or none), dense first layer, scaling factor, biases, tied head, YaRN or default rope, V3's
rope_interleave; records 4 prompts x 16 greedy tokens (ignore EOS)."""

import json
import os
import sys

import numpy as np
import torch
import transformers

seed = int(sys.argv[1])
out = sys.argv[2]
rng = np.random.default_rng(seed)
v3 = bool(rng.random() < 0.5)
heads = int(rng.choice([1, 2, 3, 4, 5]))
nope = int(rng.choice([4, 6, 8, 12]))
rope = int(rng.choice([2, 4, 6, 8]))
rank = int(rng.choice([8, 12, 16, 20])) + (int(rng.random() < 0.5) if v3 else 0)
groups = int(rng.choice([1, 2, 4]))
experts = groups * int(rng.choice([2, 3, 4]))
kept = int(rng.integers(1, groups + 1))
topk = int(rng.integers(1, min(4, experts // groups * kept) + 1))
cfg = dict(
    vocab_size=int(rng.choice([97, 256, 333])),
    hidden_size=heads * 8,
    intermediate_size=int(rng.choice([36, 64])),
    moe_intermediate_size=int(rng.choice([8, 12, 16])),
    num_hidden_layers=int(rng.choice([1, 2, 3])),
    num_attention_heads=heads,
    q_lora_rank=None if rng.random() < 0.5 else int(rng.choice([8, 16, 24])),
    kv_lora_rank=rank,
    qk_nope_head_dim=nope,
    qk_rope_head_dim=rope,
    v_head_dim=int(rng.choice([4, 8, 10])),
    n_routed_experts=experts,
    num_experts_per_tok=topk,
    n_shared_experts=int(rng.choice([0, 1, 2])) or None,
    first_k_dense_replace=int(rng.choice([0, 1])),
    routed_scaling_factor=float(rng.choice([1.0, 1.7, 2.5])),
    attention_bias=bool(rng.random() < 0.3),
    tie_word_embeddings=bool(rng.random() < 0.3),
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)
if cfg["n_shared_experts"] is None:
    cfg["n_shared_experts"] = 0
if v3:
    cfg.update(
        n_group=groups,
        topk_group=kept,
        norm_topk_prob=bool(rng.random() < 0.5),
        rope_interleave=bool(rng.random() < 0.6),
    )
else:
    cfg.update(topk_method="group_limited_greedy" if groups > 1 else "greedy", n_group=groups, topk_group=kept)
if rng.random() < 0.5:
    cfg["rope_parameters"] = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=float(rng.choice([2.0, 4.0, 8.0])),
        mscale=float(rng.choice([0.707, 1.0])),
        mscale_all_dim=float(rng.choice([0.0, 0.707, 1.0])),
        original_max_position_embeddings=64,
    )
else:
    cfg["rope_parameters"] = dict(rope_type="default", rope_theta=float(rng.choice([1e4, 5e5])))
torch.manual_seed(seed)
C = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
M = transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM
config = C(**cfg)
config.initializer_range = 0.2
config._experts_implementation = "eager"
model = M(config).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if p.dim() == 1:
            p.add_(0.3 * torch.randn_like(p))
        elif n.endswith("mlp.gate.weight"):
            p.mul_(5.0)
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn_like(b))
model.save_pretrained(out)
prompts = [[1] + rng.integers(3, cfg["vocab_size"], size=int(n)).tolist() for n in rng.integers(1, 70, size=4)]
expected = [
    model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, len(p) :
    ].tolist()
    for p in prompts
]
json.dump(dict(prompts=prompts, expected=expected, config=cfg, v3=v3), open(os.path.join(out, "fuzz.json"), "w"))
