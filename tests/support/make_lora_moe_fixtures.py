"""Build tiny PEFT LoRA adapters on the routed experts of tests/fixtures/qwen3_moe and mixtral, and record
PEFT's greedy outputs.

Run once, when the adapters need to change (needs torch, transformers >= 5 and peft):

    /tmp/hf-venv/bin/python tests/support/make_lora_moe_fixtures.py

transformers 5 stores each MoE layer's experts as fused 3-D params (mlp.experts.gate_up_proj [X, 2F, E],
mlp.experts.down_proj [X, E, F]), which PEFT adapts through `target_parameters` (lora.ParamWrapper: per expert
A [r, in] and B [out, r], written as one lora_A [X * r, in] and lora_B [out, r * X]; two targets on one module
nest, the second under `base_layer`). Each adapter is written by PEFT's own save_pretrained in
tests/lora/fixtures/<name>/ with random A and B; tests/lora/fixtures/moe_expected.json holds, per base model,
the base model's and each adapter's greedy continuation (PeftModel over a fresh base) of a few prompts.
"""

from __future__ import annotations

import json
import os
import shutil

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
OUT = os.path.join(os.path.dirname(FIXTURES), "lora", "fixtures")
MAX_NEW_TOKENS = 12
NUM_PROMPTS = 4

# base fixture -> {adapter name: LoraConfig options}: experts with attention, and experts' down_proj alone
# under rsLoRA and a per-parameter rank, so that reading either wrongly shows in the greedy tokens.
ADAPTERS = {
    "qwen3_moe": {
        "qwen3_moe_experts_r4": dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
        "qwen3_moe_down_r2_rslora": dict(
            r=3,
            lora_alpha=4,
            use_rslora=True,
            rank_pattern={"down_proj": 2},
            target_modules=[],
            target_parameters=["mlp.experts.down_proj"],
        ),
    },
    "mixtral": {
        "mixtral_experts_r3": dict(
            r=3,
            lora_alpha=6,
            target_modules=["o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    },
}


def load_base(base: str):
    path = os.path.join(FIXTURES, base)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        outputs.append(generated[0, input_ids.shape[1] :].tolist())
    return outputs


def build(base: str, name: str, options: dict, seed: int, prompts: list[list[int]]) -> list[list[int]]:
    torch.manual_seed(seed)
    model = get_peft_model(load_base(base), LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **options))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_A" in param_name or "lora_B" in param_name:
                param.copy_(torch.randn_like(param) * 0.5)
    directory = os.path.join(OUT, name)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    os.remove(os.path.join(directory, "README.md"))  # PEFT's model card template
    loaded = PeftModel.from_pretrained(load_base(base), directory).eval()
    return greedy(loaded, prompts)


def main() -> None:
    record: dict = dict(transformers_version=transformers.__version__, peft_version=peft.__version__, bases={})
    seed = 100
    for base, adapters in ADAPTERS.items():
        with open(os.path.join(FIXTURES, base, "expected.json")) as f:
            prompts = [prompt["token_ids"] for prompt in json.load(f)["prompts"]][:NUM_PROMPTS]
        entry = dict(prompts=prompts, base_greedy_token_ids=greedy(load_base(base), prompts), greedy_token_ids={})
        for name, options in adapters.items():
            seed += 1
            entry["greedy_token_ids"][name] = build(base, name, options, seed, prompts)
        record["bases"][base] = entry
    with open(os.path.join(OUT, "moe_expected.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
