"""Speculative decoding with the n-gram (prompt-lookup) proposer and with a draft model: single-stream
generated tokens/s with speculation vs without, on two workloads, jaxserve beside llama.cpp's server (plain,
with its own lookup decoding, --spec-type ngram-simple, and with a draft model, --model-draft) in the same
run; and batched throughput with speculation on vs off (goal: not below).

    .venv/bin/python bench/speculative.py [--precision f32] [--requests 3] [--repeats 1] [--max-tokens 256] [--batch 32]
        [--variants plain,ngram,ngram-forced,draft,draft-forced,ngram-forced:k4:min2] [--k 7] [--lookup-min 1]
        [--draft-k K] [--draft-quantization auto|int4|int8|source] [--llamacpp-build auto] [--request-timeout 300]
        [--llamacpp-budget 1200]

Draft rows: jaxserve's target is the --precision file (F32, or Q8_0 served with quantization auto), its
draft the target's own --draft-quantization copy (draft_model: self, quantized as it loads: self-speculation;
auto, the default: int8 for an F32 target, int4 for the others, self_draft_quantization says why;
with a Q8_0 target, the draft file below); llama.cpp serves the same target file with the file
llama-quantize writes from the F32 one (int4: Q4_0, int8: Q8_0) as --model-draft. The policy's variants as
for ngram: "draft" adaptive, "draft-forced" always speculating; "draft-gguf" (not run by default):
adaptive, with that very draft file as jaxserve's draft (quantization auto: its blocks as stored).
--draft-quantization source: both engines' draft is the model's own GGUF file as published (the default
model's Q4_1 file, of which the F32 target is the exact dequantization: a 4-bit draft with the target's
weights; Q4_0 / Q8_0 re-quantize those weights once more). llama.cpp's servers all run one build: on an AMX
CPU native-no-amx when one loads a quantized file (its native build crashes there), else native.
Sweeps in one run: a variant name may carry ":k<N>", ":min<N>", ":max<N>" (k, prompt_lookup_min / max),
e.g. --variants plain,ngram-forced,ngram-forced:k4:min2,ngram:k5:min3:max5.

Bounded in time: every llama-server call has a timeout (--request-timeout, seconds; its start-up 300 s),
and each llama.cpp server gets --llamacpp-budget seconds in all: past it, or after a timed-out call, the
server is stopped and its rows report the requests it finished ("partial": true) or none.

The default model (SmolLM2-135M-Instruct) as vs_llamacpp.py serves it: its GGUF dequantized to F32 (or
BF16), the same file loaded by both engines, 2 threads each. Prompts are chat prompts rendered once with
the model's template and sent to both engines as the same token ids; greedy; a reply ends at EOS or at
--max-tokens.

  code   code editing: the prompt holds a Python function and asks for it back with one change (the
         reply quotes most of its context: what prompt lookup is for)
  chat   plain chat questions (little to look up)

Single stream: --requests requests one after another per workload; rate = generated tokens / wall time
(prefill included). --repeats N (jaxserve): every variant's engine is started first, then N rounds run each
variant's workloads in turn (in reverse order every other round), and each keeps its fastest run (on a shared
machine the load shifts between variants run one after another; the idle runs' ngram-forced code ratio read
1.65-1.83x over three runs of one variant each); a last table gives each round's speculation / plain and their
median ("taking turns": the figure to quote where the machine's speed drifts within minutes). jaxserve's ngram
engine runs its default adaptive policy and, as a second line, with speculation forced on (speculative_adaptive
false). Batched: --batch chat requests at once (EOS ignored, --batch-tokens each), jaxserve only, one of each
round's workloads under --repeats (best of the rounds).
Greedy outputs with speculation on and off are compared (they must be identical). Prints JSON lines, then
a table of ratios (speculation / plain in each engine, and jaxserve / llama.cpp for the same kind of row:
plain, ngram vs lookup, draft vs draft).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_peer as peer  # noqa: E402
from vs_llamacpp import (  # noqa: E402
    CACHE_DIR,
    DTYPES,
    QUANTIZED_PRECISIONS,
    emit,
    model_files,
    pin_threads,
    quantized_gguf,
)

DRAFT_FILES = {"int4": "Q4_0", "int8": "Q8_0"}  # the draft's quantization -> llama.cpp's draft file
# "source": the model's own GGUF file as published, blocks as stored (the default model's is Q4_1, and the
# F32 target both engines serve is its exact dequantization: this draft has the target's weights at 4 bits)
DRAFT_QUANTIZATIONS = (*DRAFT_FILES, "source", "auto")


def self_draft_quantization(args) -> str:
    """--draft-quantization auto: the self-draft that pays for the target's precision on a CPU. A float32
    target's int8 copy (a quarter of its bytes) agreed with it on 0.95 of chat tokens here, its int4 copy (an
    eighth) on 0.68, and the int4 draft's extra misses cost more than its cheaper steps save (session 52, the
    AMD EPYC: chat 1.51x vs 1.11x of speculation off, in one process, alternating). A 16-bit or quantized
    target's int8 copy reads half of the target's bytes or all of them: int4 there."""
    if args.draft_quantization != "auto":
        return args.draft_quantization
    return "int8" if args.precision == "f32" else "int4"


def draft_pair(args, ggufs: dict) -> tuple[dict, str]:
    """(jaxserve's draft settings, llama.cpp's --model-draft file) for --draft-quantization: int4 / int8 a
    self-draft quantized as it loads beside llama-quantize's Q4_0 / Q8_0 file; source the model's own GGUF
    file in both engines (quantization auto). k is --draft-k, or the engine's own default for these settings
    (6 for an int8 self-draft, else 4), which llama.cpp's --spec-draft-n-max gets too."""
    from jaxserve.config import SpeculativeConfig

    quantization = self_draft_quantization(args)
    if quantization == "source":
        from jaxserve.loading.default_model import resolve_model_path

        path = resolve_model_path(args.model)
        if not path.endswith(".gguf"):
            raise SystemExit(f"--draft-quantization source needs a model published as a GGUF file, not {path}")
        draft, draft_gguf = dict(method="draft", draft_model=path, draft_quantization="auto"), path
    else:
        draft = dict(method="draft", draft_model="self", draft_quantization=quantization)
        draft_gguf = quantized_gguf(ggufs, DRAFT_FILES[quantization])
    k = args.draft_k if args.draft_k is not None else SpeculativeConfig(**draft).num_speculative_tokens
    return {**draft, "num_speculative_tokens": k}, draft_gguf


CODE_SNIPPETS = (
    '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
''',
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if count < 0:
            raise ValueError("count must be non-negative")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        available = self.items.get(name, 0)
        if count > available:
            raise KeyError(name)
        self.items[name] = available - count

    def total(self):
        return sum(self.items.values())
""",
    """def parse_config(lines):
    config = {}
    section = None
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            config[section] = {}
            continue
        key, value = line.split("=", 1)
        config[section][key.strip()] = value.strip()
    return config
""",
)
CODE_ASKS = (
    "Rename the variable `total` to `running_sum` in this function. Reply with the whole function.",
    "Rename the method `total` to `count_all` in this class. Reply with the whole class.",
    "Rename `section` to `current_section` in this function. Reply with the whole function.",
)
CHAT_QUESTIONS = (
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue in a few sentences.",
    "Give me some tips for learning a new language.",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle.",
)


def prompts_for(tokenizer, workload: str, count: int) -> list[list[int]]:
    from jaxserve.loading.chat_template import render_chat

    if workload == "code":
        messages = [
            f"{CODE_ASKS[i % 3]}\n\n```python\n{CODE_SNIPPETS[i % 3]}```" for i in range(count)
        ]  # fmt: skip
    else:
        messages = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count)]
    return [
        tokenizer.encode(
            render_chat(tokenizer, [{"role": "user", "content": m}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for m in messages
    ]


class Jaxserve:
    def __init__(
        self,
        path: str,
        dtype: str,
        max_num_seqs: int,
        max_model_len: int,
        speculative: dict | None,
        quantization: str = "none",
    ):
        from jaxserve import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        options: dict[str, Any] = dict(
            quantization=quantization,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,  # as llama.cpp's cache_prompt=False: every run prefills its prompts
            show_progress=False,
        )
        if speculative:
            options["speculative"] = speculative
        self.llm = LLM(path, **options)

    def run(self, prompts, max_tokens: int, at_once: bool, ignore_eos: bool = False):
        """(generated token ids per request, seconds)."""
        params = self.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        groups = [prompts] if at_once else [[p] for p in prompts]
        outputs, start = [], time.perf_counter()
        for group in groups:
            outputs += self.llm.generate(group, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], time.perf_counter() - start


def llama_complete(
    server: peer.LlamaServer, prompt: list[int], max_tokens: int, timeout: float, drafts: dict | None = None
) -> list[int]:
    """Greedy token ids; drafts (when given) sums the server's draft_n / draft_n_accepted timings, when it
    reports them. Raises TimeoutError (or URLError) past `timeout` seconds."""
    body = dict(
        prompt=prompt,
        n_predict=max_tokens,
        temperature=0.0,
        top_k=1,
        cache_prompt=False,
        return_tokens=True,
        stream=False,
    )
    reply = peer.post_json(f"http://127.0.0.1:{server.port}/completion", body, timeout)
    for key in ("draft_n", "draft_n_accepted"):
        if drafts is not None and key in reply.get("timings", {}):
            drafts[key] = drafts.get(key, 0) + reply["timings"][key]
    return reply["tokens"]


def run_llamacpp(
    gguf: str,
    threads: int,
    context: int,
    workloads: dict,
    max_tokens: int,
    extra: list[str],
    limits: tuple,
    build: str,
) -> tuple[dict, bool]:
    """({workload: (token ids per finished request, seconds)}, whether it finished every request): the
    server (of the named build) is stopped at the first call past its timeout or once its budget of seconds
    is spent."""
    request_timeout, budget = limits
    server = peer.LlamaServer(CACHE_DIR, gguf, threads, 1, context_per_slot=context, build=build)
    server.command += extra
    results, drafts, deadline = {}, {}, time.monotonic() + budget
    try:
        with server:
            llama_complete(server, workloads["chat"][0], 8, request_timeout)  # warm-up
            for name, prompts in workloads.items():
                tokens, start = [], time.perf_counter()
                results[name] = (tokens, 0.0)
                for prompt in prompts:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the server's budget of {budget} s is spent")
                    tokens.append(llama_complete(server, prompt, max_tokens, request_timeout, drafts))
                    results[name] = (tokens, time.perf_counter() - start)
    except (OSError, RuntimeError) as error:  # TimeoutError and URLError are OSErrors
        emit(engine="llamacpp", command_tail=extra, stopped=f"{type(error).__name__}: {error}"[:300])
        return {name: run for name, run in results.items() if run[0]}, False
    if drafts:
        emit(engine="llamacpp" + ("-draft" if "--model-draft" in extra else "-lookup" if extra else "-plain"), **drafts)
    return results, True


VARIANT_OPTIONS = {"k": "num_speculative_tokens", "min": "prompt_lookup_min", "max": "prompt_lookup_max"}
VARIANT_SWITCHES = {"kvcopy": "draft_kv_from_target"}  # <name>0 / <name>1: False / True


def variant_config(variants: dict, name: str) -> dict | None:
    """A variant by name; ":"-separated suffixes override its speculative settings, for sweeps in one run:
    "ngram-forced:k7:min3:max5" is ngram-forced with k = 7 and prompt lookup lengths 3..5; "draft:kvcopy0" the draft
    prefilling the rows it lacks instead of copying the target's pages."""
    base, *overrides = name.split(":")
    if base not in variants:
        raise SystemExit(f"unknown variant {base!r}; known: {sorted(variants)}")
    config = variants[base]
    for override in overrides:
        key = override.rstrip("0123456789")
        if key not in {**VARIANT_OPTIONS, **VARIANT_SWITCHES} or key == override or config is None:
            raise SystemExit(f"bad variant suffix {override!r} in {name!r}: one of k<N>, min<N>, max<N>, kvcopy0/1")
        value = int(override[len(key) :])
        config = (
            {**config, VARIANT_SWITCHES[key]: bool(value)}
            if key in VARIANT_SWITCHES
            else {**config, VARIANT_OPTIONS[key]: value}
        )
    return config


def best_single_runs(engines: dict, workloads: dict, max_tokens: int, repeats: int, batch: tuple) -> tuple[dict, dict]:
    """({(variant, workload): (token ids, seconds)}, the fastest of `repeats` runs; {(variant, workload): [tokens/s
    of each round]}), the engines taking turns round after round, in reverse order every other round (a shift in
    the machine's load hits every variant alike, and none is always first). `batch` is (prompts, max_tokens) of the
    batched run (workload "batch": all at once, EOS ignored; not for forced variants), or () for none."""
    best: dict = {}
    rounds: dict = {}

    def keep(variant, workload, run):
        rounds.setdefault((variant, workload), []).append(rate(*run))
        if (variant, workload) not in best or run[1] < best[variant, workload][1]:
            best[variant, workload] = run

    for round_index in range(repeats if engines else 0):
        order = list(engines.items())
        for variant, engine in order if round_index % 2 == 0 else order[::-1]:
            for workload, prompts in workloads.items():
                keep(variant, workload, engine.run(prompts, max_tokens, False))
            if batch and not is_forced(variant):
                keep(variant, "batch", engine.run(batch[0], batch[1], at_once=True, ignore_eos=True))
    return best, rounds


def taking_turns(rounds: dict) -> None:
    """Per variant and workload, speculation / plain in each round of --repeats and their median: on a machine
    whose speed drifts within minutes, the ratio of runs seconds apart says more than the ratio of best-ofs taken
    at different moments."""
    rows = []
    for (variant, workload), rates in rounds.items():
        plain = rounds.get(("plain", workload))
        if variant == "plain" or not plain:
            continue
        ratios = [round(ours / base, 3) for ours, base in zip(rates, plain)]
        median = round(statistics.median(ratios), 3)
        emit(taking_turns=f"jaxserve-{variant}", workload=workload, vs_plain_median=median, vs_plain_per_round=ratios)
        rows.append(f"| jaxserve-{variant} | {workload} | {median:.2f}x | {', '.join(f'{r:.2f}' for r in ratios)} |")
    if rows:
        print("\n| taking turns | workload | speculation / plain, median of rounds | per round |\n|---|---|---|---|")
        print("\n".join(rows))


def is_forced(variant: str) -> bool:
    return variant.split(":")[0].endswith("-forced")


def rate(tokens: list[list[int]], seconds: float) -> float:
    return round(sum(map(len, tokens)) / seconds, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a Hugging Face dir")
    parser.add_argument("--precision", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--requests", type=int, default=3, help="single-stream requests per workload")
    parser.add_argument(
        "--repeats", type=int, default=1, help="jaxserve: rounds of every variant in turn, best of each (engines kept)"
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="requests at once in the batched run (0: none)")
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens for ngram (the engine's default)")
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="jaxserve,llamacpp")
    parser.add_argument("--variants", default="plain,ngram,ngram-forced,draft,draft-forced", help="jaxserve's")
    parser.add_argument(
        "--draft-k",
        type=int,
        default=None,
        help="num_speculative_tokens with a draft model (default: the engine's own)",
    )
    parser.add_argument(
        "--draft-quantization",
        default="auto",
        choices=DRAFT_QUANTIZATIONS,
        help="of the target's own copy as the draft (int4 / int8: quantized as it loads, beside llama-quantize's "
        "Q4_0 / Q8_0 file; source: the model's own published GGUF file in both engines, see DRAFT_QUANTIZATIONS; "
        "auto: int8 for an f32 target, int4 otherwise, see self_draft_quantization)",
    )
    parser.add_argument("--llamacpp", default="plain,lookup,draft", help="llama.cpp's servers to run")
    parser.add_argument(
        "--llamacpp-build",
        default="auto",
        choices=("auto", *sorted(peer.BUILDS)),
        help="llama.cpp's build for every server of the run; auto: native, but native-no-amx on an AMX CPU when "
        "a server loads a quantized file (the draft server, a quantized --precision)",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per llama-server call")
    parser.add_argument("--llamacpp-budget", type=float, default=1200.0, help="seconds per llama.cpp server")
    args = parser.parse_args()
    pin_threads(args.threads)
    jax_path, ggufs, name = model_files(args)
    gguf_type = DTYPES[args.precision][1]
    gguf = ggufs[gguf_type] if gguf_type in ggufs else quantized_gguf(ggufs, gguf_type)
    draft, draft_gguf = draft_pair(args, ggufs)  # draft_gguf: llama.cpp's --model-draft
    quantization = "none"
    if args.precision in QUANTIZED_PRECISIONS:  # jaxserve serves that very file, its blocks as stored
        jax_path, quantization = gguf, "auto"
    from jaxserve.loading.model_source import open_model

    tokenizer = open_model(jax_path).tokenizer
    workloads = {w: prompts_for(tokenizer, w, args.requests) for w in ("code", "chat")}
    batch_prompts = prompts_for(tokenizer, "chat", args.batch) if args.batch else []
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    max_model_len = longest + args.max_tokens + 16
    emit(bench="speculative", model=name, precision=args.precision, threads=args.threads, k=args.k,
         prompt_lookup=[args.lookup_min, args.lookup_max], requests=args.requests, max_tokens=args.max_tokens,
         prompt_tokens={w: [len(p) for p in ps] for w, ps in workloads.items()})  # fmt: skip
    ngram = dict(method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min,
                 prompt_lookup_max=args.lookup_max)  # fmt: skip
    draft_file = {**draft, "draft_model": draft_gguf, "draft_quantization": "auto"}
    if quantization != "none":  # a quantized target's draft: the file llama.cpp's draft row serves
        draft = draft_file
    variants = {"plain": None, "ngram": ngram, "ngram-forced": {**ngram, "speculative_adaptive": False},
                "draft": draft, "draft-forced": {**draft, "speculative_adaptive": False}}  # fmt: skip
    variants["draft-gguf"] = draft_file  # the very pair of files llama.cpp's draft row serves, blocks as stored
    variants = {name: variant_config(variants, name) for name in args.variants.split(",")}
    single: dict[str, dict] = {}
    rounds: dict = {}  # each round's tokens/s per (variant, workload) under --repeats
    if "jaxserve" in args.engines:

        def start(speculative):
            engine = Jaxserve(
                jax_path, DTYPES[args.precision][0], max(args.batch, 1), max_model_len, speculative, quantization
            )
            engine.run(workloads["chat"][:1], 8, at_once=False)  # warm-up
            return engine

        # --repeats > 1: every engine started first, then rounds of every variant in turn (best of each, and
        # each round's ratios: taking_turns)
        kept = {variant: start(speculative) for variant, speculative in variants.items()} if args.repeats > 1 else {}
        batch = (batch_prompts, args.batch_tokens) if args.batch else ()
        best, rounds = best_single_runs(kept, workloads, args.max_tokens, args.repeats, batch)
        for variant, speculative in variants.items():
            engine = kept.pop(variant, None) or start(speculative)
            single[f"jaxserve-{variant}"] = {
                w: best.get((variant, w)) or engine.run(p, args.max_tokens, False) for w, p in workloads.items()
            }
            stats = engine.llm.stats()
            for w, (tokens, seconds) in single[f"jaxserve-{variant}"].items():
                emit(engine=f"jaxserve-{variant}", workload=w, tokens_per_s=rate(tokens, seconds),
                     generated=sum(map(len, tokens)), seconds=round(seconds, 3))  # fmt: skip
            emit(engine=f"jaxserve-{variant}", compiles_after_warmup=stats["num_compiles_after_warmup"],
                 **{k: v for k, v in stats.items() if k.startswith("speculative_")})  # fmt: skip
            if batch and not is_forced(variant):
                tokens, seconds = best.get((variant, "batch")) or engine.run(*batch, at_once=True, ignore_eos=True)
                single[f"jaxserve-{variant}"]["batch"] = (tokens, seconds)
                emit(engine=f"jaxserve-{variant}", workload=f"chat x {args.batch} at once",
                     tokens_per_s=rate(tokens, seconds), generated=sum(map(len, tokens)))  # fmt: skip
            del engine
            gc.collect()
        for variant in [v for v in variants if v != "plain" and "plain" in variants]:
            runs = single[f"jaxserve-{variant}"]
            same = all(runs[w][0] == single["jaxserve-plain"][w][0] for w in runs)
            emit(check=f"greedy tokens equal, jaxserve-{variant} vs plain", identical=same)
    if "llamacpp" in args.engines:
        # One build for all servers, so that their ratios compare kernels of one build (F32 files take no
        # AMX path: native-no-amx runs them as native does).
        quantized_file = quantization != "none" or "draft" in args.llamacpp.split(",")
        build = peer.build_for(args.llamacpp_build, quantized_file)
        peer.ensure_built(CACHE_DIR)  # its llama-quantize writes the GGUF files
        peer.ensure_built(CACHE_DIR, build)
        emit(engine="llamacpp", build=build)
        context = max_model_len
        servers = {
            "plain": [],
            "lookup": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.lookup_max),
                       "--spec-ngram-simple-size-m", str(args.k)],
            "draft": ["--model-draft", draft_gguf, "--spec-draft-n-max", str(draft["num_speculative_tokens"]),
                      "--threads-draft", str(args.threads)],
        }  # fmt: skip
        limits = (args.request_timeout, args.llamacpp_budget)
        for server in args.llamacpp.split(","):
            engine = f"llamacpp-{server}"
            runs, finished = run_llamacpp(
                gguf, args.threads, context, workloads, args.max_tokens, servers[server], limits, build
            )
            single[engine] = runs
            for w, (tokens, seconds) in runs.items():
                emit(engine=engine, workload=w, tokens_per_s=rate(tokens, seconds), generated=sum(map(len, tokens)),
                     requests=len(tokens), **({} if finished else {"partial": True}))  # fmt: skip
    report(single)
    taking_turns(rounds)


PEERS = {"plain": "llamacpp-plain", "ngram": "llamacpp-lookup", "draft": "llamacpp-draft"}  # same kind of row


def report(single: dict) -> None:
    """A table of tokens/s with two ratios per row: speculation / plain in the same engine, and jaxserve /
    llama.cpp for the same kind of speculation (plain, lookup, draft); also emitted as JSON lines."""
    print("\n| engine | workload | tokens/s | speculation / plain | jaxserve / llama.cpp |\n|---|---|---|---|---|")
    for engine, by_workload in single.items():
        base = single.get(engine.rsplit("-", 1)[0] + "-plain") if not engine.endswith("plain") else None
        peer_runs = None
        if engine.startswith("jaxserve-"):
            kind = engine.removeprefix("jaxserve-").split("-")[0]
            base = single.get("jaxserve-plain") if kind != "plain" else None
            peer_runs = single.get(PEERS.get(kind, ""))
        for workload, (tokens, seconds) in by_workload.items():
            ours = rate(tokens, seconds)
            ratios = {}
            if base is not None and workload in base:
                ratios["vs_plain"] = round(ours / rate(*base[workload]), 2)
            if peer_runs is not None and workload in peer_runs:
                ratios["vs_llamacpp"] = round(ours / rate(*peer_runs[workload]), 2)
            if ratios:
                emit(ratio=engine, workload=workload, **ratios)
            cells = [f"{ratios[key]:.2f}x" if key in ratios else "-" for key in ("vs_plain", "vs_llamacpp")]
            print(f"| {engine} | {workload} | {ours} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
