"""Record transformers' greedy outputs on the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF) for
tests/loading/test_default_model.py. Run once, when the prompts or the model change (needs torch and
transformers; fetches the model like jaxserve does):

    .venv/bin/python -m tests.support.record_default_model

transformers loads the same GGUF file (dequantized to float32, as jaxserve does) and its embedded
tokenizer. The prompts hold no digits: llama.cpp (and jaxserve) split SmolLM's digits one by one as
its tokenizer.json does, while transformers' GGUF loader does not.
"""

from __future__ import annotations

import json
import os

from jaxserve.loading.default_model import default_model_path

EXPECTED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "loading", "fixtures", "default_model.json"
)
COMPLETIONS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little"]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a neural network is.",
]
MAX_NEW_TOKENS = 40
NUM_TOP_LOGPROBS = 5


def generate(model, tokenizer, prompt_ids: list[int], eos_token_id) -> dict:
    import torch

    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids).logits[0, -1].float(), dim=-1)
        generated = model.generate(
            input_ids,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    output_ids = generated[0, len(prompt_ids) :].tolist()
    top = torch.topk(logprobs, NUM_TOP_LOGPROBS)
    return dict(
        prompt_token_ids=prompt_ids,
        token_ids=output_ids,
        text=tokenizer.decode(output_ids, skip_special_tokens=True),
        first_top_token_ids=top.indices.tolist(),
        first_top_logprobs=top.values.tolist(),
    )


def load_model(path: str):
    """transformers' GGUF model: its own dequantization and un-permutation of the file's tensors.
    (from_pretrained(gguf_file=...) would do the same but insists on accelerate.)"""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def main() -> None:
    import torch
    import transformers

    path = default_model_path()
    directory, file_name = os.path.dirname(path), os.path.basename(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
    model = load_model(path)
    # Both stop on the tokenizer's EOS, as jaxserve (and vLLM) do unless told to ignore it.
    completions = [
        dict(prompt=prompt, **generate(model, tokenizer, tokenizer.encode(prompt), tokenizer.eos_token_id))
        for prompt in COMPLETIONS
    ]
    chats = []
    for message in CHATS:
        conversation = [{"role": "user", "content": message}]
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
        chats.append(
            dict(message=message, rendered=rendered, **generate(model, tokenizer, prompt_ids, tokenizer.eos_token_id))
        )
    with open(EXPECTED, "w") as f:
        json.dump(
            dict(
                model=file_name,
                transformers_version=transformers.__version__,
                torch_version=torch.__version__,
                max_new_tokens=MAX_NEW_TOKENS,
                completions=completions,
                chats=chats,
            ),
            f,
            indent=1,
            ensure_ascii=False,
        )
    for entry in completions + chats:
        print(repr(entry.get("prompt") or entry["message"]), "->", repr(entry["text"]))


if __name__ == "__main__":
    main()
