"""What every fixture script shares (make_fixtures.py, make_deepseek_fixtures.py,
make_gemma3_multimodal_fixture.py): the prompts, the tokenizer, and how a checkpoint and transformers'
outputs on it are written (expected.json: the prompts as token ids, plus the text they came from,
transformers' greedy continuation and the log-probabilities of the first generated position).

Each script takes `--out DIR` to write somewhere other than tests/fixtures (to compare a rebuild with the
committed files without touching them)."""

from __future__ import annotations

import json
import os
import shutil

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


def split_output_option(argv: list[str]) -> tuple[str, list[str]]:
    """(the directory fixtures go to: --out DIR or tests/fixtures, the other arguments)."""
    out, rest = FIXTURES, []
    arguments = iter(argv)
    for argument in arguments:
        if argument == "--out":
            out = next(arguments)
        elif argument.startswith("--out="):
            out = argument.split("=", 1)[1]
        else:
            rest.append(argument)
    os.makedirs(out, exist_ok=True)
    return out, rest


def tokenizer_in(out: str) -> str:
    """The tokenizer in `out`: the committed one, copied there if `out` has none yet."""
    path = os.path.join(out, "tokenizer.model")
    if not os.path.exists(path):
        shutil.copy(TOKENIZER, path)
    return path


def token_prompts(rng: np.random.Generator) -> list[list[int]]:
    return [[1] + rng.integers(3, VOCAB_SIZE, size=n - 1).tolist() for n in TOKEN_PROMPT_LENGTHS]


def save_checkpoint(model, directory: str, tokenizer: str) -> None:
    """The model (in its own dtype) and the tokenizer, in a fresh directory."""
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    shutil.copy(tokenizer, os.path.join(directory, "tokenizer.model"))


def record_outputs(model, directory: str, tokenizer: str, seed: int, model_type: str, dtype: str) -> None:
    """Write directory/expected.json from `model` (loaded back in float32, as a user would load it): the text
    prompts and the seed's random token prompts, each with its greedy continuation and first top logprobs."""
    processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
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
