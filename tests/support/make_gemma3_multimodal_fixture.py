"""Build tests/fixtures/gemma3_multimodal: a tiny Gemma3ForConditionalGeneration (model_type gemma3, as
gemma-3-4b-it is: text_config, a SigLIP vision tower and a projector, a tied head) written by transformers, and
record its text-only outputs in make_fixtures.py's format (its prompts and tokenizer).

    /tmp/hfvenv/bin/python -m tests.support.make_gemma3_multimodal_fixture

The vision tower is one layer over 28x28 images (2x2 patches, 4 image tokens): it only has to exist, since
jaxserve serves the language model alone. The image token ids lie inside the tiny vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import sentencepiece
import torch
import transformers

from tests.support.make_fixtures import (
    COMMON,
    FIXTURES,
    MAX_NEW_TOKENS,
    NUM_TOP_LOGPROBS,
    TEXT_PROMPTS,
    TOKENIZER,
    token_prompts,
)

NAME = "gemma3_multimodal"
SEED = 27
TEXT_CONFIG = dict(
    **COMMON,
    hidden_size=40,
    intermediate_size=52,
    num_hidden_layers=3,
    num_attention_heads=5,
    num_key_value_heads=1,
    head_dim=8,
    query_pre_attn_scalar=8,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1_000_000.0),
        sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
    ),
)
VISION_CONFIG = dict(
    hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def main() -> None:
    directory = os.path.join(FIXTURES, NAME)
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(SEED)
    config = transformers.Gemma3Config(
        text_config=TEXT_CONFIG,
        vision_config=VISION_CONFIG,
        mm_tokens_per_image=4,
        boi_token_index=380,
        eoi_token_index=381,
        image_token_index=382,
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # as make_fixtures.build: larger weights, perturbed norms (Gemma's start at zero)
        for _, param in model.named_parameters():
            if param.dim() > 1:
                param.mul_(4.0)
            else:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    shutil.copy(TOKENIZER, os.path.join(directory, "tokenizer.model"))
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    processor = sentencepiece.SentencePieceProcessor(model_file=TOKENIZER)
    prompts = [dict(text=text, token_ids=[1] + processor.EncodeAsIds(text)) for text in TEXT_PROMPTS]
    prompts += [dict(text=None, token_ids=ids) for ids in token_prompts(np.random.default_rng(SEED))]
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
            dict(model_type="gemma3", dtype="float32", transformers_version=transformers.__version__, prompts=prompts),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
