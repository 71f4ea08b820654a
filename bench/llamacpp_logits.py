"""jaxserve's next-token distributions against llama.cpp's on the same GGUF and the very same tokens, per
position (issue #25's "text close to llama.cpp's"): llama-perplexity's --kl-divergence-base file holds
llama.cpp's log-probabilities at positions n_ctx/2 .. n_ctx-2 of each chunk of the text; jaxserve scores the
same chunks (prompt_logprobs, top 20) and each configuration is compared with the base over the base's top-20
tokens: how often the argmax agrees, |d logprob| of the base's top token, a partial KL, and both perplexities
on the scored positions. Another llama.cpp file (a run with other flags) compares the same way, which gives
the ceiling: on quantized files llama.cpp with its flash attention off differs from itself as much as
jaxserve does (docs/notes/quantization.md, session 11).

    B=~/.cache/jaxserve/llama.cpp-b10605/build/bin D=~/.cache/jaxserve/vs_llamacpp/SmolLM2-135M-Instruct.Q4_1
    $B/llama-perplexity -m $D/Q8_0.gguf -f bench/data/kjv_genesis_1-9.txt -c 512 -b 512 --chunks 2 -t 2 \
        --kl-divergence-base /tmp/q8.bin   # (again with -fa off --kl-divergence-base /tmp/q8fa0.bin)
    bench/llamacpp_logits.py /tmp/q8.bin llama:/tmp/q8fa0.bin "jx:$D/Q8_0.gguf:{}" \
        "jx:$D/Q8_0.gguf:{\"quantized_activations\": \"float\"}"
"""

from __future__ import annotations

import json
import statistics
import struct
import sys

import numpy as np

TOP = 20


def read_logits(path: str):
    """(tokens int32 [chunks, n_ctx], log-probs float32 [chunks, positions, vocab], first scored position)."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
        (n_ctx,) = struct.unpack("i", f.read(4))
        n_vocab, n_chunk = struct.unpack("ii", f.read(8))
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), np.int32).reshape(n_chunk, n_ctx)
        width = 2 * ((n_vocab + 1) // 2) + 4  # per position: scale and min as two floats, then uint16s
        first = n_ctx // 2
        raw = np.frombuffer(f.read(), np.uint16).reshape(n_chunk, n_ctx - 1 - first, width)
    header = raw[..., :4].copy().view(np.float32)
    return tokens, header[..., 1:2] + header[..., 0:1] * raw[..., 4 : 4 + n_vocab].astype(np.float32), first


def top_tokens(log_probs) -> list[list[dict[int, float]]]:
    order = np.argsort(-log_probs, axis=-1)[..., :TOP]
    return [
        [{int(t): float(row[t]) for t in top} for row, top in zip(chunk, tops)] for chunk, tops in zip(log_probs, order)
    ]


def compare(base, other) -> str:
    same, top_drift, kl, n = 0, [], [], 0
    for base_chunk, other_chunk in zip(base, other):
        for b, o in zip(base_chunk, other_chunk):
            n += 1
            best = max(b, key=b.__getitem__)
            same += best == max(o, key=o.__getitem__)
            if best in o:
                top_drift.append(abs(b[best] - o[best]))
            kl.append(sum(np.exp(v) * (v - o[t]) for t, v in b.items() if t in o))
    return f"same top {same / n:.4f}  mean |d lp| of top {statistics.mean(top_drift):.4f}  partial KL {statistics.mean(kl):.5f}"


def jaxserve_logprobs(path: str, options: dict, tokens, first: int, positions: int):
    import gguf

    from jaxserve import LLM, SamplingParams

    fields = gguf.GGUFReader(path).fields
    adds = fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(adds.parts[adds.data[0]][0]) if adds else False
    bos = int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0])
    kwargs = dict(quantization="auto", max_model_len=2 * tokens.shape[1], max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(path, show_progress=False, **{**kwargs, **options})
    prompts = [[bos, *map(int, t[1:])] if add_bos else list(map(int, t)) for t in tokens]  # as llama-perplexity
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP))
    scored = [[o.prompt_logprobs[first + 1 + p] for p in range(positions)] for o in outputs]
    nll = [-s[p][int(t[first + 1 + p])] for s, t in zip(scored, prompts) for p in range(positions)]
    return scored, float(np.exp(np.mean(nll)))


def main() -> None:
    tokens, base_log_probs, first = read_logits(sys.argv[1])
    positions = base_log_probs.shape[1]
    base = top_tokens(base_log_probs)
    picked = base_log_probs[np.arange(len(tokens))[:, None], np.arange(positions), tokens[:, first + 1 :]]
    print(f"base perplexity on the scored positions {np.exp(-np.mean(picked)):.4f}", flush=True)
    for spec in sys.argv[2:]:
        if spec.startswith("llama:"):
            print(spec, compare(base, top_tokens(read_logits(spec[6:])[1])), flush=True)
            continue
        path, options = spec[3:].split(".gguf:", 1)  # the options are JSON, colons included
        scored, perplexity = jaxserve_logprobs(path + ".gguf", json.loads(options or "{}"), tokens, first, positions)
        print(spec, compare(base, scored), f"perplexity {perplexity:.4f}", flush=True)


if __name__ == "__main__":
    main()
