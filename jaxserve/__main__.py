"""`python -m jaxserve [MODEL_DIR] --prompt TEXT`: generate offline; the embedded default model without MODEL_DIR."""

import argparse
import json

from jaxserve import LLM, SamplingParams
from jaxserve.loading.default_model import default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", help="a Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    llm = LLM(args.model or default_model_dir(), dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=16, max_num_batched_tokens=256)
    prompts = args.prompt or ["def forward(self, x):", "Return a new dictionary", "The quick brown fox"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    for output in outputs:
        completion = output.outputs[0]
        print(json.dumps(dict(prompt=output.prompt, text=completion.text, token_ids=completion.token_ids,
                              finish_reason=completion.finish_reason)))
    print(json.dumps(dict(stats=llm.stats())))


if __name__ == "__main__":
    main()
