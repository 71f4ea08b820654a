"""Build tests/fixtures/gemma3_multimodal: a tiny Gemma3ForConditionalGeneration (model_type gemma3, as
gemma-3-4b-it is: text_config, a SigLIP vision tower and a projector, a tied head) written by transformers, and
record its text-only outputs in make_fixtures.py's format (its prompts and tokenizer).

    /tmp/hfvenv/bin/python -m tests.support.make_gemma3_multimodal_fixture  # [--out DIR]: elsewhere

The vision tower is one layer over 28x28 images (2x2 patches, 4 image tokens): it only has to exist, since
jaxserve serves the language model alone. The image token ids lie inside the tiny vocabulary.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

from tests.support.fixture_recording import COMMON, record_outputs, save_checkpoint, split_output_option, tokenizer_in

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
    out, _ = split_output_option(sys.argv[1:])
    tokenizer = tokenizer_in(out)
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
    directory = os.path.join(out, NAME)
    save_checkpoint(model, directory, tokenizer)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    record_outputs(model, directory, tokenizer, SEED, "gemma3", "float32")


if __name__ == "__main__":
    main()
