"""Routing across replicas: the same multi-turn workload through `jaxserve.router` under each policy, in one run.

Three replicas of the tiny random Llama (`model.path: tiny-random`) run on this machine with small KV caches
(and a small host tier), so that a replica holding every conversation must evict. Users hold conversations
that all start with one shared system prompt; every turn resends the conversation so far plus a new user
message, and many users' turns interleave. Each policy gets fresh conversations (new random tokens), so no
policy finds what another left cached. The replicas' prefill budget is small (max_num_batched_tokens 48):
a step's time then grows with the prompt tokens it computes, as it does for a real model on an accelerator,
where the tiny model on a CPU would otherwise hide prefill behind per-step overhead.

Prints JSON lines: per policy the prefix-cache hit rate (the replicas' num_cached_tokens over prompt tokens),
p50/p99 time to first token seen by the clients, throughput and per-replica requests; the oracle hit rate
(one replica with an unlimited cache, computed from the same requests: the ceiling); then the comparisons the
issue asks for. A plot (TTFT distributions, hit rates against the oracle) is written beside.

    .venv/bin/python bench/router.py [--users 9 --conversations 18 --turns 8] [--plot router.png]
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import tempfile
import threading
import time

import numpy as np

from jaxserve.client import Client
from jaxserve.router.cache_view import prefix_keys
from jaxserve.router.config import parse_config
from jaxserve.router.launcher import launch_replicas
from jaxserve.router.server import RouterServer

VOCAB = 384  # the tiny random Llama's
PAGE_SIZE = 16


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def conversations(seed: int, args) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user messages) per conversation; the system prompt is shared by all of a policy's."""
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, VOCAB) for _ in range(args.system_tokens - 1)]
    return [
        (system, [[rng.randrange(3, VOCAB) for _ in range(args.user_tokens)] for _ in range(args.turns)])
        for _ in range(args.conversations)
    ]


def run_user(target: str, work: queue.Queue, records: list, args, rng: random.Random) -> None:
    client = Client(target)
    try:
        while True:
            try:
                session_id, (system, messages) = work.get_nowait()
            except queue.Empty:
                return
            history = list(system)
            for message in messages:
                time.sleep(rng.expovariate(1 / args.think_time))  # interleaves the users' turns
                prompt = history + message
                record = {"prompt": prompt, "sent": time.perf_counter(), "output": []}
                for response in client.stream(
                    prompt, max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True, session_id=session_id
                ):
                    if "first" not in record:
                        record["first"] = time.perf_counter()
                        record["cached"] = response.num_cached_tokens
                    record["output"] += response.token_ids
                record["done"] = time.perf_counter()
                records.append(record)
                history = prompt + record["output"]
    finally:
        client.close()


def run_policy(policy: str, addresses: list[str], args, seed: int) -> dict:
    router = RouterServer(
        parse_config(
            {
                "model": {"path": "tiny-random"},
                "replicas": addresses,
                "router": {"port": 0, "policy": policy, "startup_timeout": 60},
            }
        )
    )
    router.start()
    try:
        work, records = queue.Queue(), []
        for index, conversation in enumerate(conversations(seed, args)):
            work.put((f"conversation-{seed}-{index}", conversation))
        started = time.perf_counter()
        users = [
            threading.Thread(
                target=run_user, args=(f"127.0.0.1:{router.port}", work, records, args, random.Random(seed * 1000 + u))
            )
            for u in range(args.users)
        ]
        for user in users:
            user.start()
        for user in users:
            user.join()
        elapsed = time.perf_counter() - started
        per_replica = {r.address: int(router.metrics.requests.labels(r.address)._value.get()) for r in router.replicas}
        moves = {
            f"{kind}_{tier}_pages": int(
                sum(router.metrics.page_events.labels(r.address, kind, tier)._value.get() for r in router.replicas)
            )
            for kind, tier in (("removed", "device"), ("stored", "host"), ("removed", "host"))
        }
    finally:
        router.stop()
    return {**summarize(policy, records, elapsed, per_replica), **moves}


def oracle_hit_rate(records: list[dict]) -> float:
    """One replica with an unlimited cache, and optimistic: a request finds every full page of the requests
    sent before it (their prompts, as if computed at once) and of the answers finished before it."""
    events = sorted(
        [(r["sent"], 1, "prompt", r) for r in records]
        + [(r["done"], 2, "answer", r) for r in records]
        + [(r["sent"], 0, "query", r) for r in records],
        key=lambda event: event[:2],
    )
    cached, hits, total = set(), 0, 0
    for _, _, kind, record in events:
        if kind == "query":
            keys = prefix_keys(record["prompt"], PAGE_SIZE)
            found = next((i for i, key in enumerate(keys) if key not in cached), len(keys))
            hits, total = hits + found * PAGE_SIZE, total + len(record["prompt"])
        else:
            tokens = record["prompt"] + (record["output"] if kind == "answer" else [])
            cached.update(prefix_keys(tokens + [0], PAGE_SIZE))  # + [0]: every full page, the last one included
    return hits / total


def summarize(policy: str, records: list[dict], elapsed: float, per_replica: dict) -> dict:
    ttft = np.array([r["first"] - r["sent"] for r in records])
    return dict(
        policy=policy,
        requests=len(records),
        hit_rate=round(sum(r["cached"] for r in records) / sum(len(r["prompt"]) for r in records), 4),
        oracle_hit_rate=round(oracle_hit_rate(records), 4),
        ttft_p50_ms=round(1e3 * float(np.percentile(ttft, 50)), 1),
        ttft_p99_ms=round(1e3 * float(np.percentile(ttft, 99)), 1),
        requests_per_s=round(len(records) / elapsed, 2),
        output_tokens_per_s=round(sum(len(r["output"]) for r in records) / elapsed, 1),
        requests_per_replica=list(per_replica.values()),
        seconds=round(elapsed, 1),
        ttft_s=ttft.tolist(),
    )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        ttft = np.sort(result["ttft_s"]) * 1e3
        left.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=result["policy"])
    left.set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT")
    left.legend()
    names = [r["policy"] for r in results]
    right.bar(names, [r["hit_rate"] for r in results], color="tab:blue", label="hit rate")
    right.scatter(
        names,
        [r["oracle_hit_rate"] for r in results],
        color="black",
        marker="_",
        s=600,
        label="oracle (one replica, unlimited cache)",
    )
    right.set(ylim=(0, 1.3), ylabel="prompt tokens found cached", title="prefix-cache hit rate")
    right.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="round_robin,prefix,least_load,session")
    parser.add_argument("--users", type=int, default=9, help="conversations in progress at once")
    parser.add_argument("--conversations", type=int, default=18, help="per policy")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=int, default=16)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument(
        "--prefill-budget", type=int, default=48, help="the replicas' max_num_batched_tokens (a multiple of 16)"
    )
    parser.add_argument("--think-time", type=float, default=0.05, help="mean seconds between a user's turns")
    parser.add_argument("--num-pages", type=int, default=96, help="KV pages per replica (16 tokens each)")
    parser.add_argument("--swap-space", type=float, default=0.002, help="GiB of host tier per replica")
    parser.add_argument("--plot", default=None, help="PNG path; default: a temporary directory")
    args = parser.parse_args()
    max_len = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    engine = [
        f"engine.max_model_len={max_len + PAGE_SIZE}",
        f"engine.num_pages={args.num_pages}",
        f"engine.swap_space={args.swap_space}",
        "engine.max_num_seqs=8",
        f"engine.max_num_batched_tokens={args.prefill_budget}",
        "engine.show_progress=false",
        "model.dtype=float32",
    ]
    replicas = launch_replicas(3, "tiny-random", None, tuple(engine), tempfile.mkdtemp(prefix="bench-router-"), 600)
    addresses = [replica.address for replica in replicas]
    emit(
        setup="replicas",
        count=3,
        num_pages=args.num_pages,
        swap_space=args.swap_space,
        users=args.users,
        conversations=args.conversations,
        turns=args.turns,
        longest_prompt=max_len - args.answer_tokens,
    )
    results = []
    try:
        for seed, policy in enumerate(args.policies.split(","), start=1):
            result = run_policy(policy, addresses, args, seed)
            emit(**{k: v for k, v in result.items() if k != "ttft_s"})
            results.append(result)
    finally:
        for replica in replicas:
            replica.stop()
    by_policy = {r["policy"]: r for r in results}
    if "prefix" in by_policy and "round_robin" in by_policy:
        prefix, round_robin = by_policy["prefix"], by_policy["round_robin"]
        emit(
            comparison="prefix vs round_robin and the oracle",
            hit_rate_over_oracle=round(prefix["hit_rate"] / prefix["oracle_hit_rate"], 3),
            p50_ttft_round_robin_over_prefix=round(round_robin["ttft_p50_ms"] / prefix["ttft_p50_ms"], 2),
            p99_ttft_round_robin_over_prefix=round(round_robin["ttft_p99_ms"] / prefix["ttft_p99_ms"], 2),
        )
    path = args.plot or f"{tempfile.mkdtemp(prefix='bench-router-')}/router.png"
    plot(results, path)
    emit(plot=path)


if __name__ == "__main__":
    main()
