"""A llama GGUF file of random weights at any shape, with the default model's tokenizer: a configuration neither
engine was tuned on, for bench/vs_llamacpp.py (`--model FILE.gguf`, which both engines then load).

    .venv/bin/python bench/random_gguf.py OUT.gguf [--hidden 1024] [--ffn 2816] [--layers 20] [--heads 16]
        [--kv-heads 4] [--head-dim 64] [--tied]

The tokenizer and the chat template are the default model's (SmolLM2-135M-Instruct's GGUF, vocabulary 49152),
so the bench's prompts tokenize as they do for it; the weights are float32 N(0, 0.02) with unit norms. Greedy
text from random weights is noise, and near-ties between its logits make the engines' greedy agreement a poor
check there: the file is for speed.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The model's shape keys, set from the arguments; every other key (tokenizer, template, rope) is copied
SHAPE_KEYS = {
    "llama.block_count": "layers",
    "llama.embedding_length": "hidden",
    "llama.feed_forward_length": "ffn",
    "llama.attention.head_count": "heads",
    "llama.attention.head_count_kv": "kv_heads",
    "llama.rope.dimension_count": "head_dim",
    "llama.attention.key_length": "head_dim",
    "llama.attention.value_length": "head_dim",
}


def write_random_gguf(out: str, args) -> None:
    import gguf

    from jaxserve.loading.default_model import default_model_path

    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(out, "llama")
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in SHAPE_KEYS:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    for key, name in SHAPE_KEYS.items():
        writer.add_uint32(key, getattr(args, name))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(args.seed)

    def matrix(rows: int, columns: int) -> np.ndarray:  # numpy [rows, columns] is GGUF's ne [columns, rows]
        return (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)

    hidden, q_width, kv_width = args.hidden, args.heads * args.head_dim, args.kv_heads * args.head_dim
    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not args.tied:
        writer.add_tensor("output.weight", matrix(vocab, hidden))
    for layer in range(args.layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(prefix + "attn_q.weight", matrix(q_width, hidden))
        writer.add_tensor(prefix + "attn_k.weight", matrix(kv_width, hidden))
        writer.add_tensor(prefix + "attn_v.weight", matrix(kv_width, hidden))
        writer.add_tensor(prefix + "attn_output.weight", matrix(hidden, q_width))
        writer.add_tensor(prefix + "ffn_gate.weight", matrix(args.ffn, hidden))
        writer.add_tensor(prefix + "ffn_up.weight", matrix(args.ffn, hidden))
        writer.add_tensor(prefix + "ffn_down.weight", matrix(hidden, args.ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tied", action="store_true", help="no output.weight: the head is the embedding")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    write_random_gguf(args.out, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
