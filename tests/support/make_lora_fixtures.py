"""Build tiny PEFT LoRA adapters over tests/fixtures/llama_gqa and record PEFT's greedy outputs.

Run once, when the adapters need to change (needs torch, transformers and peft: the bench extras):

    /tmp/hf-venv/bin/python tests/support/make_lora_fixtures.py          # the llama_gqa adapters
    /tmp/hf-venv/bin/python tests/support/make_lora_fixtures.py phi3     # an adapter of Phi-3's fused projections

Each adapter is written by PEFT's own save_pretrained (adapter_config.json + adapter_model.safetensors)
in tests/lora/fixtures/<name>/; their A and B matrices are random (PEFT starts B at zero, which would
make every adapter the base model). tests/lora/fixtures/expected.json holds, per adapter, PeftModel's
greedy continuation of the base fixture's prompts. The suite itself never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
BASE = os.path.join(FIXTURES, "llama_gqa")
OUT = os.path.join(os.path.dirname(FIXTURES), "lora", "fixtures")
MAX_NEW_TOKENS = 16

# Different ranks, targets and scalings (rslora, a per-module rank and alpha), so that reading any of them
# wrongly shows in the greedy tokens.
ADAPTERS = {
    "attn_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp_r8_rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "mixed_r3": dict(
        r=3,
        lora_alpha=5,
        target_modules=["v_proj", "o_proj", "down_proj", "q_proj"],
        rank_pattern={"q_proj": 6},
        alpha_pattern={"q_proj": 3},
    ),
}


# Phi-3's checkpoints fuse q/k/v (qkv_proj) and gate/up (gate_up_proj): PEFT adapts the fused modules.
PHI3_BASE = os.path.join(FIXTURES, "phi3")
PHI3_ADAPTER = (
    "phi3_fused_r4",
    dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
)


def build(name: str, options: dict, seed: int, base_dir: str = BASE) -> list[list[int]]:
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **options))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_A" in param_name or "lora_B" in param_name:
                param.copy_(torch.randn_like(param) * 0.5)
    directory = os.path.join(OUT, name)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    os.remove(os.path.join(directory, "README.md"))  # PEFT's model card template
    # Greedy outputs from the adapter as a user loads it: PeftModel over a fresh base.
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(base, directory).eval()
    outputs = []
    for prompt in prompts(base_dir):
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = loaded.generate(
                input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        outputs.append(generated[0, input_ids.shape[1] :].tolist())
    return outputs


def prompts(base_dir: str = BASE) -> list[list[int]]:
    with open(os.path.join(base_dir, "expected.json")) as f:
        return [prompt["token_ids"] for prompt in json.load(f)["prompts"]]


def main_phi3() -> None:
    name, options = PHI3_ADAPTER
    greedy = build(name, options, seed=7, base_dir=PHI3_BASE)
    record = dict(base="phi3", adapter=name, prompts=prompts(PHI3_BASE), greedy_token_ids=greedy)
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    expected = {name: build(name, options, seed) for seed, (name, options) in enumerate(ADAPTERS.items())}
    base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    base_outputs = []
    for prompt in prompts():
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = base.generate(
                input_ids=input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        base_outputs.append(generated[0, input_ids.shape[1] :].tolist())
    import peft

    record = dict(
        base="llama_gqa",
        transformers_version=transformers.__version__,
        peft_version=peft.__version__,
        prompts=prompts(),
        base_greedy_token_ids=base_outputs,
        greedy_token_ids=expected,
    )
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main_phi3() if sys.argv[1:] == ["phi3"] else main()
