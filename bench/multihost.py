"""Multi-host serving on one CPU: the same model and mesh as 1 process x 8 devices and as 2 processes x 4
devices (jax.distributed, gloo collectives over loopback TCP, plans through the coordination service).

Each run serves the same greedy workload twice (the first pass warms up) and reports the second pass's
engine steps and seconds per step; the 2-process run also reports how long process 0 spent sending
plans. The ratio (2 processes / 1) is the whole cost of going multi-process here: cross-process
collectives instead of in-process ones, plan sending, replicating the sampled rows, and two Python
processes sharing the machine's cores. Prints JSON lines.

    .venv/bin/python bench/multihost.py [--model tiny-random] [--mesh tp8,dp2tp4] [--prompts 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {
    "tp8": {"tensor_parallel_size": 8},
    "dp2tp4": {"data_parallel_size": 2, "tensor_parallel_size": 4},
    "dp8": {"data_parallel_size": 8},
}
NOTE = (
    "fake CPU devices share the machine's cores, and so do the two processes: the ratio is overhead "
    "(collectives over loopback TCP, plans, two Pythons), not what separate hosts would see"
)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def serve(model: str, mesh: str, num_prompts: int, num_tokens: int, group=None) -> dict:
    """In a child process: build the engine (a follower runs plans instead) and time the workload."""
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.distributed.follower import run_follower

    engine = dict(
        dtype="float32",
        max_model_len=256,
        max_num_seqs=num_prompts,
        max_num_batched_tokens=128,
        decode_seq_buckets=(num_prompts,),
        show_progress=False,
        compilation_cache_dir=None,
        **MESHES[mesh],
    )
    llm = LLM(model, process_group=group, **engine)
    if jax.process_index() > 0:
        run_follower(llm.engine.parts, group)
        return {}
    prompts = [[1 + (7 * i + j) % 300 for j in range(20 + 3 * i)] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up pass
    runner = llm.engine.runner
    steps, sending = llm.engine.num_steps, getattr(runner, "seconds_sending_plans", 0.0)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    steps = llm.engine.num_steps - steps
    result = {
        "steps": steps,
        "ms_per_step": 1000 * seconds / steps,
        "seconds": seconds,
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }
    if hasattr(runner, "seconds_sending_plans"):
        result["ms_sending_plans_per_step"] = 1000 * (runner.seconds_sending_plans - sending) / steps
        runner.shutdown()
    return result


def time_all_reduce(hidden_size: int, num_tokens: int, repeats: int = 50) -> float:
    """Milliseconds for one all-reduce of a [tokens, hidden] float32 activation over all 8 devices (what a
    tensor-parallel layer does twice), issued by every process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(jax.devices()), ("tensor",))
    partial = jax.make_array_from_callback(
        (8 * num_tokens, hidden_size),
        NamedSharding(mesh, PartitionSpec("tensor")),
        lambda index: np.ones((num_tokens, hidden_size), np.float32),
    )
    summed = jax.jit(
        lambda x: x.reshape(8, num_tokens, hidden_size).sum(0), out_shardings=NamedSharding(mesh, PartitionSpec())
    )
    summed(partial).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        summed(partial).block_until_ready()
    return 1000 * (time.perf_counter() - started) / repeats


def child(args) -> None:
    group = None  # one process
    if args.process is not None:
        from jaxserve.distributed.config import DistributedConfig
        from jaxserve.distributed.runtime import initialize

        group = initialize(
            DistributedConfig(
                coordinator_address=f"127.0.0.1:{args.port}",
                num_processes=2,
                process_id=args.process,
                num_cpu_devices=4,
                peer_timeout=120,
            )
        )
    result = serve(args.model, args.mesh, args.prompts, args.tokens, group)
    all_reduce = time_all_reduce(hidden_size=256, num_tokens=args.prompts)
    if result:
        result["ms_per_all_reduce"] = all_reduce
        print("RESULT " + json.dumps(result), flush=True)
    if args.process is not None:
        import jax

        jax.distributed.shutdown()


def run(args, processes: int) -> dict:
    common = [
        "--child",
        "--model",
        args.model,
        "--mesh",
        args.mesh,
        "--prompts",
        str(args.prompts),
        "--tokens",
        str(args.tokens),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if processes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        commands = [[sys.executable, __file__, *common]]
    else:
        env.pop("XLA_FLAGS", None)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        commands = [[sys.executable, __file__, *common, "--process", str(i), "--port", str(port)] for i in range(2)]
    children = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for command in commands
    ]
    try:
        outputs = [c.communicate(timeout=1200)[0] for c in children]
    finally:
        for c in children:
            c.kill()
    lines = [line for line in outputs[0].splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{processes}-process run failed: {outputs[0][-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--mesh", default="tp8,dp2tp4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--process", type=int)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.child:
        return child(args)
    for mesh in args.mesh.split(","):
        args.mesh = mesh
        one, two = run(args, 1), run(args, 2)
        emit(
            bench="multihost",
            model=args.model,
            mesh=mesh,
            prompts=args.prompts,
            tokens=args.tokens,
            steps=one["steps"],
            ms_per_step_1x8=round(one["ms_per_step"], 2),
            ms_per_step_2x4=round(two["ms_per_step"], 2),
            ratio=round(two["ms_per_step"] / one["ms_per_step"], 3),
            ms_sending_plans_per_step=round(two["ms_sending_plans_per_step"], 3),
            ms_per_all_reduce_1x8=round(one["ms_per_all_reduce"], 3),
            ms_per_all_reduce_2x4=round(two["ms_per_all_reduce"], 3),
            same_tokens=one["tokens"] == two["tokens"],
            note=NOTE,
        )


if __name__ == "__main__":
    main()
