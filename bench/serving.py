"""Serving benchmark: drive a running jaxserve server over gRPC or its OpenAI HTTP API and report latency
and throughput.

Arrivals: Poisson at --request-rate (req/s), Gamma with --burstiness (< 1 burstier, 1 = Poisson), or a
fixed --max-concurrency. Datasets: random prompt/output lengths, shared-prefix groups (a long system
prompt per group), or multi-turn conversations (each turn resends the conversation so far). Metrics
follow vLLM's definitions: TTFT (time to first token), TPOT (time per output token after the first),
ITL (time between streamed messages), E2E latency; mean, p50, p90, p99, as one JSON object.

    python -m jaxserve.serve &                      # or any config
    .venv/bin/python bench/serving.py --num-prompts 64 --request-rate 8 [--plot latency.png]

--backend grpc|openai|grpc,openai picks the API (openai: POST /v1/completions streamed, at --http-target,
bench/serving_openai.py); with both, each runs the same load in turn on the same server (--rounds N
alternates their order; each run draws its own prompts, so no run finds another's prefixes cached),
or, with --interleave, one run sends every other request to each, so that both meet the same load
at every moment (on a shared machine, the fairer comparison); a last line compares them: the p50s
and throughputs, and openai's over grpc's.

--hostile KIND (bench/hostile.py: big-prompts, many-stops, stop-ids, unread) runs the same requests
twice, alone and then beside hostile clients, and reports both and the ratio of their latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from jaxserve.client import AsyncClient, Client, add_connection_arguments, connection_from_arguments


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    start: float = 0.0
    ttft: float | None = None
    end: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    answer: list[int] = field(default_factory=list)
    backend: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def random_dataset(rng, args, vocab_size):
    return [
        (
            rng.integers(3, vocab_size, size=int(rng.integers(args.min_input, args.max_input + 1))).tolist(),
            int(rng.integers(args.min_output, args.max_output + 1)),
        )
        for _ in range(args.num_prompts)
    ]


def shared_prefix_dataset(rng, args, vocab_size):
    systems = [rng.integers(3, vocab_size, size=args.system_len).tolist() for _ in range(args.groups)]
    items = [
        (systems[i % args.groups] + rng.integers(3, vocab_size, size=args.question_len).tolist(), args.max_output)
        for i in range(args.num_prompts)
    ]
    return [items[i] for i in rng.permutation(len(items))]


def arrival_gaps(rng, args, count):
    if args.request_rate == float("inf"):
        return np.zeros(count)
    shape = args.burstiness
    return rng.gamma(shape, 1.0 / (args.request_rate * shape), size=count)


async def one_request(client: AsyncClient, prompt, max_tokens, session_id="") -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt), start=time.perf_counter())
    last = result.start
    try:
        async for response in client.stream(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, session_id=session_id
        ):
            now = time.perf_counter()
            if response.token_ids:
                if result.ttft is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += len(response.token_ids)
                result.answer += response.token_ids
            result.cached_tokens = response.num_cached_tokens
    except Exception as error:  # gRPC errors are results too: they are counted, not raised
        result.error = str(error)
    result.end = time.perf_counter()
    return result


async def run_independent(clients, dataset, args, rng) -> list[RequestResult]:
    """clients: (backend, client) pairs; request i goes to pair i mod len(clients)."""
    semaphore = asyncio.Semaphore(args.max_concurrency or len(dataset))

    async def limited(index, prompt, max_tokens):
        backend, client = clients[index % len(clients)]
        async with semaphore:
            result = await one_request(client, prompt, max_tokens)
        result.backend = backend
        return result

    tasks = []
    for index, ((prompt, max_tokens), gap) in enumerate(zip(dataset, arrival_gaps(rng, args, len(dataset)))):
        tasks.append(asyncio.create_task(limited(index, prompt, max_tokens)))
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


async def run_multi_turn(clients, args, rng, vocab_size) -> list[RequestResult]:
    semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

    async def conversation(index):
        backend, client = clients[index % len(clients)]
        history = rng.integers(3, vocab_size, size=args.question_len).tolist()
        results = []
        for _ in range(int(rng.integers(4, 9))):
            async with semaphore:
                result = await one_request(client, history, args.max_output, session_id=f"chat-{index}")
            result.backend = backend
            results.append(result)
            history = history + result.answer + rng.integers(3, vocab_size, size=args.question_len).tolist()
        return results

    tasks = []
    for index, gap in enumerate(arrival_gaps(rng, args, args.num_prompts)):
        tasks.append(asyncio.create_task(conversation(index)))
        await asyncio.sleep(gap)
    return [r for results in await asyncio.gather(*tasks) for r in results]


def summary(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    ms = np.asarray(values) * 1000
    return {
        "mean_ms": round(float(ms.mean()), 2),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p90_ms": round(float(np.percentile(ms, 90)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
    }


def report(results: list[RequestResult], elapsed: float, args) -> dict:
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return {
        "dataset": args.dataset,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(elapsed, 3),
        "request_throughput": round(len(done) / elapsed, 3),
        "output_token_throughput": round(output_tokens / elapsed, 1),
        "total_token_throughput": round((output_tokens + prompt_tokens) / elapsed, 1),
        "cached_prompt_token_fraction": round(sum(r.cached_tokens for r in done) / max(prompt_tokens, 1), 3),
        "ttft": summary(r.ttft for r in done),
        "tpot": summary(r.tpot for r in done),
        "itl": summary(gap for r in done for gap in r.itl),
        "e2e_latency": summary(r.e2e for r in done),
    }


def plot(results: list[RequestResult], start: float, path: str) -> None:
    import matplotlib  # a bench extra, only needed for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.error is None]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, values in (
        ("TTFT", [r.ttft for r in done]),
        ("TPOT", [r.tpot for r in done if r.tpot]),
        ("ITL", [g for r in done for g in r.itl]),
        ("E2E", [r.e2e for r in done]),
    ):
        ordered = np.sort(np.asarray(values) * 1000)
        latency.plot(ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1), label=label)
    latency.set(xscale="log", xlabel="milliseconds", ylabel="fraction of requests", title="latency CDF")
    latency.legend()
    ends = np.sort([r.end - start for r in done])
    throughput.plot(ends, np.arange(1, len(ends) + 1))
    throughput.set(xlabel="seconds", ylabel="requests completed", title="throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def make_client(backend: str, args, info, connection):
    if backend == "grpc":
        return AsyncClient(args.target, connection)
    from serving_openai import OpenAIStreamClient

    return OpenAIStreamClient(
        args.http_target, info.model, connection.api_key, args.tls_ca, args.tls_cert, args.tls_key
    )


def compare(runs: dict[str, list[dict]]) -> dict:
    """Each backend's medians over its runs of the headline numbers, and the second's over the first's."""
    first, second = list(runs)[:2]
    line = {"compare": f"{second} / {first}"}
    for name, read in (
        ("ttft_p50_ms", lambda r: r["ttft"].get("p50_ms")),
        ("itl_p50_ms", lambda r: r["itl"].get("p50_ms")),
        ("e2e_latency_p50_ms", lambda r: r["e2e_latency"].get("p50_ms")),
        ("output_token_throughput", lambda r: r["output_token_throughput"]),
    ):
        medians = {backend: float(np.median([read(r) or 0.0 for r in reports])) for backend, reports in runs.items()}
        line[name] = medians
        line[f"{name}_ratio"] = round(medians[second] / medians[first], 3) if medians[first] else None
    return line


async def run_once(
    args, info, connection, backends: list[str] | tuple[str, ...] = ("grpc",), seed_offset: int = 0
) -> tuple[list[RequestResult], float, float]:
    """One run of the load; with several backends, its requests alternate between them."""
    rng = np.random.default_rng(args.seed + seed_offset)
    clients = [(backend, make_client(backend, args, info, connection)) for backend in backends]
    start = time.perf_counter()
    if args.dataset == "multi-turn":
        results = await run_multi_turn(clients, args, rng, info.vocab_size)
    else:
        make = random_dataset if args.dataset == "random" else shared_prefix_dataset
        results = await run_independent(clients, make(rng, args, info.vocab_size), args, rng)
    elapsed = time.perf_counter() - start
    for _, client in clients:
        await client.close()
    return results, start, elapsed


async def main_async(args) -> None:
    connection = connection_from_arguments(args)
    info = Client(args.target, connection).server_info()
    header = {"model": info.model, "attention_impl": info.attention_impl}
    backends, runs, seed_offset = args.backend.split(","), {}, 0
    groups = [backends] if args.interleave else [[backend] for backend in backends]
    for round_index in range(args.rounds):
        for group in groups if round_index % 2 == 0 else groups[::-1]:
            results, start, elapsed = await run_once(args, info, connection, group, seed_offset)
            seed_offset += 1
            for backend in group:
                alone = report([r for r in results if r.backend == backend], elapsed, args)
                runs.setdefault(backend, []).append(alone)
                print(json.dumps({**header, "backend": backend, "interleaved": len(group) > 1, **alone}), flush=True)
    if len(runs) > 1:
        print(json.dumps(compare(runs)))
    if args.plot:
        plot(results, start, args.plot)
    if args.hostile:
        import hostile

        clients = hostile.HostileClients(args.hostile, args.target, connection, info.max_num_seqs)
        await asyncio.sleep(5.0)  # let the hostile process start and its clients get going
        alone = runs[backends[0]][0]
        results, start, elapsed = await run_once(args, info, connection, backends[:1])
        counts = clients.stop()
        beside = report(results, elapsed, args)
        ratios = {
            f"{metric}_p50_ratio": round(beside[metric]["p50_ms"] / alone[metric]["p50_ms"], 3)
            for metric in ("ttft", "e2e_latency")
            if alone[metric] and beside[metric]
        }
        print(json.dumps({**header, "hostile": args.hostile, "hostile_outcomes": counts, **beside, **ratios}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="the gRPC port (server info comes from it)")
    parser.add_argument("--http-target", default="http://127.0.0.1:8000", help="the OpenAI HTTP API")
    parser.add_argument("--backend", default="grpc", help="grpc, openai, or both as grpc,openai")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each backend, in alternating order")
    parser.add_argument(
        "--interleave", action="store_true", help="with several backends: one run whose requests alternate between them"
    )
    parser.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (conversations for multi-turn)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=0, help="0: unlimited")
    parser.add_argument("--min-input", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write latency CDFs and throughput to this PNG (needs matplotlib)")
    parser.add_argument("--hostile", help="also run beside these hostile clients (bench/hostile.py) and compare")
    add_connection_arguments(parser)
    args = parser.parse_args()
    if not args.backend or set(args.backend.split(",")) - {"grpc", "openai"}:
        parser.error(f"--backend takes grpc, openai or grpc,openai, not {args.backend!r}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
