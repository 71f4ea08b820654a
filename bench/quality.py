"""What quantized weights cost in quality, beside what they save: perplexity on a fixed public-domain text and
greedy agreement with the unquantized model, per `model.quantization`, with weight bytes and decode speed.

    .venv/bin/python bench/quality.py [--model default] [--formats none,int8,int4,auto] [--group-size 32]
                                      [--max-tokens 4096] [--window 512] [--prompts 8] [--generate 32]

The text is bench/data/kjv_genesis_1-9.txt (bench/data/README.md says where it comes from). Perplexity: the
text's first max-tokens tokens in windows of `window` tokens, each scored teacher-forced (prompt_logprobs, in
the prefill: one step per chunk), exp of the mean negative log-likelihood of every token after a window's
first. Greedy agreement: `prompts` prompts of 48 tokens taken from the text, `generate` greedy tokens each;
reported as the share of positions where a format's token equals the first format's (the baseline, `none`)
and the mean length of the common prefix. Decode speed: one stream of `generate` tokens, best of two, in the
same process run as the baseline. Each format prints a JSON line; the last line compares them.

The default model's only checkpoint is llama.cpp's Q4_1 GGUF: `none` is those weights dequantized to float32,
`auto` and `int4` serve its Q4_1 blocks as stored (4 bits already), `int8` re-quantizes the dequantized values.
To measure jaxserve's own int4 against llama.cpp's files, start from an F32 GGUF of the same weights (bench/
vs_llamacpp.py writes one with llama-quantize) and name the other files as variants:

    bench/quality.py --model F32.gguf --formats none,int8,int4,Q8_0.gguf:auto,Q4_0.gguf:auto

`--llamacpp` puts llama.cpp beside every GGUF variant (issue #25's "text close to llama.cpp's on the same
file"): `llama-perplexity` on the same file and text (built once, bench/llamacpp_peer.py), jaxserve's
perplexity computed the way llama-perplexity computes it (chunks of `window` tokens of the text tokenized with
its special tokens, a chunk's first token replaced by BOS where the vocabulary adds one, only the second half
of each chunk scored), and greedy agreement of jaxserve's tokens with llama-server's on the same prompts,
beside llama-server's agreement with itself with its flash attention off (the ceiling: on quantized files
int8-rounded activations turn any change in the order of additions into different tokens; session 11 of
docs/notes/quantization.md):

    bench/quality.py --model F32.gguf --formats none,Q8_0.gguf:auto,Q4_0.gguf:auto,Q4_K_M.gguf:auto --llamacpp
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "kjv_genesis_1-9.txt")
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")  # llama.cpp's build, as vs_llamacpp.py's


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def perplexity(llm, token_ids: list[int], window: int, bos: int | None) -> float:
    from jaxserve import SamplingParams

    step = window - (1 if bos is not None else 0)
    windows = [token_ids[i : i + step] for i in range(0, len(token_ids), step)]
    windows = [([bos] if bos is not None else []) + w for w in windows if len(w) > 1]
    outputs = llm.generate(windows, SamplingParams(max_tokens=0, prompt_logprobs=1))
    total, count = 0.0, 0
    for prompt, output in zip(windows, outputs):
        first_scored = 2 if bos is not None else 1  # the BOS predicts the window's first token: not text
        for token, scores in zip(prompt[first_scored:], output.prompt_logprobs[first_scored:]):
            total -= scores[token]
            count += 1
    return math.exp(total / count)


def perplexity_as_llamacpp(llm, token_ids: list[int], n_ctx: int, bos: int | None) -> float:
    """llama-perplexity's figure (tools/perplexity/perplexity.cpp, `perplexity()`): whole chunks of n_ctx
    tokens, the first token of each replaced by BOS where the vocabulary adds one, each chunk's tokens
    n_ctx / 2 + 1 .. n_ctx - 1 scored (the first half is context)."""
    from jaxserve import SamplingParams

    chunks = [list(token_ids[i : i + n_ctx]) for i in range(0, len(token_ids) - n_ctx + 1, n_ctx)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    outputs = llm.generate(chunks, SamplingParams(max_tokens=0, prompt_logprobs=1))
    total, count = 0.0, 0
    for chunk, output in zip(chunks, outputs):
        for position in range(n_ctx // 2 + 1, n_ctx):
            total -= output.prompt_logprobs[position][chunk[position]]
            count += 1
    return math.exp(total / count)


def llamacpp_build(gguf: str) -> str:
    """The llama.cpp build for this file: on an AMX CPU the native build dies on quantized files (llamacpp_peer's
    BUILDS), so those run on the build without AMX, as bench/vs_llamacpp.py's --llamacpp-build auto does."""
    import gguf as gguf_package
    import llamacpp_peer as peer

    floats = {gguf_package.GGMLQuantizationType.F32, gguf_package.GGMLQuantizationType.F16}
    floats.add(gguf_package.GGMLQuantizationType.BF16)
    quantized = any(tensor.tensor_type not in floats for tensor in gguf_package.GGUFReader(gguf).tensors)
    return peer.build_for("auto", quantized)


def llamacpp_perplexity(gguf: str, n_ctx: int, chunks: int, threads: int) -> float:
    import llamacpp_peer as peer

    build = llamacpp_build(gguf)
    peer.ensure_built(CACHE_DIR, build, extra_targets=("llama-perplexity",))
    command = [peer.binary(CACHE_DIR, "llama-perplexity", build), "-m", gguf, "-f", TEXT, "-c", str(n_ctx)]
    command += ["-b", str(n_ctx), "--chunks", str(chunks), "-t", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed ({result.returncode}): {result.stderr[-2000:]}")
    return float(found.group(1))


def llamacpp_greedy(
    gguf: str, prompts: list[list[int]], num_tokens: int, threads: int, extra_args: tuple[str, ...] = ()
) -> list[list[int]]:
    import llamacpp_peer as peer

    build = llamacpp_build(gguf)
    peer.ensure_built(CACHE_DIR, build)
    server = peer.LlamaServer(CACHE_DIR, gguf, threads, 1, max(map(len, prompts)) + num_tokens + 16, build=build)
    server.command += list(extra_args)
    with server:
        return [server.complete(prompt, num_tokens)["tokens"] for prompt in prompts]


def compare_with_llamacpp(llm, gguf: str, text: str, prompts, tokens, args) -> dict:
    """llama.cpp's perplexity and greedy tokens on the same file, beside jaxserve's computed its way."""
    tokenizer = llm.engine.parts.source.tokenizer
    with_special = tokenizer.encode(text, add_special_tokens=True)
    plain = tokenizer.encode(text, add_special_tokens=False)
    adds_bos = len(with_special) > len(plain) and with_special[1:] == plain[: len(with_special) - 1]
    bos = with_special[0] if adds_bos else None
    chunks = min(args.max_tokens, len(with_special)) // args.window
    ours = perplexity_as_llamacpp(llm, with_special[: chunks * args.window], args.window, bos)
    theirs = llamacpp_perplexity(gguf, args.window, chunks, args.threads)
    reference = llamacpp_greedy(gguf, prompts, args.generate, args.threads)
    versus = agreement(reference, tokens)
    # the ceiling: on quantized files rounding x to int8 amplifies any change in the order of additions, so
    # llama.cpp with its flash attention off disagrees with itself too (docs/notes/quantization.md, session 11)
    itself = agreement(reference, llamacpp_greedy(gguf, prompts, args.generate, args.threads, ("-fa", "off")))
    return dict(
        perplexity_llamacpp_method=ours,
        llamacpp_perplexity=theirs,
        perplexity_ratio_vs_llamacpp=ours / theirs,
        greedy_token_agreement_vs_llamacpp=versus["greedy_token_agreement"],
        mean_common_prefix_vs_llamacpp=versus["mean_common_prefix"],
        llamacpp_self_agreement_flash_attention_off=itself["greedy_token_agreement"],
    )


def greedy(llm, prompts, num_tokens: int) -> list[list[int]]:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def decode_tokens_per_second(llm, prompt, num_tokens: int) -> float:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        llm.generate([prompt], params)
        best = min(best, time.perf_counter() - start)
    return num_tokens / best


def agreement(baseline: list[list[int]], tokens: list[list[int]]) -> dict:
    same = [a == b for base, got in zip(baseline, tokens) for a, b in zip(base, got)]
    prefixes = []
    for base, got in zip(baseline, tokens):
        prefix = 0
        while prefix < min(len(base), len(got)) and base[prefix] == got[prefix]:
            prefix += 1
        prefixes.append(prefix)
    return dict(greedy_token_agreement=sum(same) / len(same), mean_common_prefix=sum(prefixes) / len(prefixes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--formats",
        default="none,int8,int4,auto",
        help="model.quantization values, or PATH:quantization for another file of the model; first: baseline",
    )
    parser.add_argument("--group-size", type=int, default=32, help="int4's quantization_group_size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantized-activations", default="int8", choices=("int8", "float"), help="the CPU quantized kernel's x"
    )
    parser.add_argument("--max-tokens", type=int, default=4096, help="of the text, for perplexity")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generate", type=int, default=32)
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp's perplexity and greedy tokens beside")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    args = parser.parse_args()
    if args.llamacpp:
        sys.path.insert(0, HERE)

    from jaxserve import LLM

    with open(TEXT) as f:
        text = f.read()
    results, baseline = {}, None
    for variant in args.formats.split(","):
        model, _, quantization = variant.rpartition(":")
        model = model or args.model
        start = time.perf_counter()
        llm = LLM(
            model,
            dtype=args.dtype,
            quantization=quantization,
            quantization_group_size=args.group_size,
            quantized_activations=args.quantized_activations,
            max_model_len=args.window + args.generate + 64,
            max_num_seqs=max(8, args.prompts),
            max_num_batched_tokens=args.window,
            show_progress=False,
        )
        load_seconds = time.perf_counter() - start
        tokenizer = llm.engine.parts.source.tokenizer
        token_ids = tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
        bos = getattr(tokenizer, "bos_token_id", None)
        stride = max(1, (len(token_ids) - 48) // args.prompts)
        prompts = [token_ids[i * stride : i * stride + 48] for i in range(args.prompts)]
        record = dict(
            model=os.path.basename(model),
            quantization=quantization,
            group_size=args.group_size if quantization == "int4" else None,
            dtype=args.dtype,
            text_tokens=len(token_ids),
            perplexity=perplexity(llm, token_ids, args.window, bos),
            weights_device_bytes=llm.stats()["weights_device_bytes"],
            decode_tokens_per_second=decode_tokens_per_second(llm, prompts[0], args.generate),
            load_seconds=load_seconds,
        )
        tokens = greedy(llm, prompts, args.generate)
        baseline = baseline or tokens
        record.update(agreement(baseline, tokens))
        if args.llamacpp and model.endswith(".gguf") and quantization in ("none", "auto"):  # the file's weights
            record.update(compare_with_llamacpp(llm, model, text, prompts, tokens, args))
        record["num_compiles_after_warmup"] = llm.stats()["num_compiles_after_warmup"]
        emit(**record)
        results[variant if model == args.model else f"{os.path.basename(model)}:{quantization}"] = record
        del llm
        gc.collect()
    first = next(iter(results.values()))
    emit(
        summary={
            name: dict(
                perplexity_ratio=r["perplexity"] / first["perplexity"],
                weights_bytes_ratio=r["weights_device_bytes"] / first["weights_device_bytes"],
                decode_speed_ratio=r["decode_tokens_per_second"] / first["decode_tokens_per_second"],
                greedy_token_agreement=r["greedy_token_agreement"],
                **{k: r[k] for k in ("perplexity_ratio_vs_llamacpp", "greedy_token_agreement_vs_llamacpp") if k in r},
            )
            for name, r in results.items()
        }
    )


if __name__ == "__main__":
    main()
