"""Multi-host serving (issue #15) on one machine: 2 processes x 4 fake CPU devices, gloo collectives,
a loopback coordinator on a free port; every process is killed in the end.

One two-process run (worker.py) serves four engines in turn and answers most assertions: tensor
parallelism across the processes, data-parallel ranks on different processes, experts spread over both
(6 experts on 8 devices) and moved between them, a checkpoint both processes wrote, and last a plan
divergence (a test hook in process 1) that must stop both processes with an error naming the step.
"""

import json
import signal
import sys
import time

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve import LLM, SamplingParams
from jaxserve.client import Client
from tests.distributed.launch import ProcessPair, free_port, run_workers
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihost")
    started = time.monotonic()
    codes, logs = run_workers(directory, timeout=600)
    assert (directory / "results.json").exists(), (
        f"exit codes {codes}\n--- process 0\n{logs[0][-3000:]}\n--- process 1\n{logs[1][-3000:]}"
    )
    with open(directory / "results.json") as f:
        return {
            **json.load(f),
            "directory": directory,
            "codes": codes,
            "logs": logs,
            "seconds": time.monotonic() - started,
        }


def assert_equals_transformers(outcome):
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3


def test_tensor_and_data_parallel_across_processes_equal_transformers(main_run):
    assert (main_run["process_count"], main_run["device_count"]) == (2, 8)
    for key in ("tp8", "dp2tp4"):  # tensor split over both processes; a data-parallel rank on each
        assert_equals_transformers(main_run[key])
        assert main_run[key]["devices_holding_kv"] == [0, 1]


def test_prompt_logprobs_across_processes_equal_one_process(main_run):
    """Prompt logprobs reach process 0 from a data-parallel rank on process 1 too (the leader replicates them
    only for steps whose rows asked: leader_runner.execute_everywhere)."""
    from tests.distributed.worker_prompts import scored_prompts

    two = main_run["dp2tp4"]["prompt_logprobs"]
    one = scored_prompts(LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE), "llama_gqa")
    assert [s is None for s in two] == [s is None for s in one] == [True, False, True, False]
    for scored_two, scored_one in zip(two, one):
        for position_two, position_one in zip(scored_two or [], scored_one or []):
            if position_one is None:
                assert position_two is None
                continue
            assert_top_logprobs_alike(position_two, position_one, 1e-4)


def assert_top_logprobs_alike(got, want, tolerance):
    """Two top-k lists of (token, logprob), best first, from other meshes (and XLA code generation): alike
    logprobs position by position, and the same token at each position but among near-ties: a token in another
    place must hold, in `want`, a logprob within tolerance of that place's (or, absent, sit at `want`'s cut)."""
    assert len(got) == len(want)
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < tolerance, (got, want)
    wanted = dict(want)
    for (token, logprob), (token_wanted, logprob_wanted) in zip(got, want):
        if token != token_wanted:
            elsewhere = wanted.get(token, want[-1][1] if abs(logprob - want[-1][1]) < tolerance else None)
            assert elsewhere is not None and abs(elsewhere - logprob_wanted) < 2 * tolerance, (got, want)


def test_expert_parallel_across_processes_equals_transformers_and_moves(main_run):
    outcome = main_run["ep8"]
    assert_equals_transformers(outcome)
    assert outcome["expert_devices_before"] == [[0, 1, 2, 3, 4, 5]] * 2  # 6 experts on 8 devices: 2 hold none
    moved = outcome["expert_devices_moved"]
    assert moved != outcome["expert_devices_before"]
    # experts crossed between the processes (devices 0-3 are process 0's, 4-7 process 1's)
    assert any(
        (before < 4) != (after < 4)
        for layer_before, layer_after in zip(outcome["expert_devices_before"], moved)
        for before, after in zip(layer_before, layer_after)
    )
    assert_equals_transformers(outcome["after_rebalance"])
    assert outcome["compiles_after_warmup"] == 0


def test_checkpoints_of_two_processes_restore_into_one(main_run):
    """Both processes wrote their shards: the tensor-parallel model, and the expert-parallel one after its
    experts moved across processes (saved in canonical order); each restores onto one device."""
    for checkpoint, name, tokens in (
        ("checkpoint", "llama_gqa", main_run["tp8"]["token_ids"]),
        ("ep_checkpoint", "mixtral_6x", main_run["ep8"]["token_ids"]),
    ):
        llm = LLM(str(main_run["directory"] / checkpoint), **SMALL_ENGINE)
        prompts = expected(name)["prompts"]
        outputs = llm.generate(
            [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in outputs] == tokens
        assert [o.outputs[0].token_ids for o in outputs] == [p["greedy_token_ids"] for p in prompts]


def test_plan_divergence_stops_every_process_naming_the_step(main_run):
    """Process 1 changed step 1's token ids; the digest check 4 plans later stops both processes."""
    codes, logs = main_run["codes"], main_run["logs"]
    assert codes == [3, 3], f"exit codes {codes}\n{logs[0][-2000:]}\n{logs[1][-2000:]}"
    assert "plans diverged at step 1 (plan 1)" in logs[1]
    assert "process 1: plans diverged at step 1" in logs[0]  # the leader names the follower and the step


def _health(port: int):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status


def _serve_pair(tmp_path, main_run, peer_timeout: float) -> tuple[ProcessPair, int]:
    """`python -m jaxserve.serve` as processes 0 and 1 (the main run's first engine, whose executables are in
    that run's persistent cache), once process 0 is SERVING; its gRPC port."""
    coordinator, grpc_port = free_port(), free_port()
    config = {
        "model": {"path": fixture_dir("llama_gqa"), "dtype": "float32"},
        "engine": {
            **{k: v for k, v in SMALL_ENGINE.items() if k != "dtype"},
            "decode_seq_buckets": [8],
            "tensor_parallel_size": 8,
            "compilation_cache_dir": str(main_run["directory"] / "xla_cache"),
        },
        "server": {"port": grpc_port, "http_port": 0, "metrics_port": 0},
        "distributed": {
            "coordinator_address": f"127.0.0.1:{coordinator}",
            "num_processes": 2,
            "num_cpu_devices": 4,
            "peer_timeout": peer_timeout,
            "initialization_timeout": 60,
        },
    }
    paths = []
    for process_id in range(2):
        paths.append(tmp_path / f"process{process_id}.yaml")
        paths[-1].write_text(
            yaml.safe_dump({**config, "distributed": {**config["distributed"], "process_id": process_id}})
        )
    pair = ProcessPair(tmp_path, lambda i: [sys.executable, "-m", "jaxserve.serve", "--config", str(paths[i])])
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if pair.processes[0].poll() is not None:
            pair.kill()
            raise AssertionError(pair.log(0)[-3000:])
        try:
            if _health(grpc_port) == SERVING:
                return pair, grpc_port
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    pair.kill()
    raise AssertionError(f"the leader never served:\n{pair.log(0)[-3000:]}")


def test_serve_on_two_processes_answers_then_stops_both_on_sigterm(tmp_path, main_run):
    """Completions over gRPC from the two-process server equal transformers' greedy tokens; SIGTERM on
    process 0 drains it, ends process 1's plan loop, and both leave the program with exit code 0."""
    pair, grpc_port = _serve_pair(tmp_path, main_run, peer_timeout=30.0)
    try:
        client = Client(f"127.0.0.1:{grpc_port}")
        for prompt in expected("llama_gqa")["prompts"][:2]:
            completion = client.generate(prompt["token_ids"], max_tokens=24, temperature=0.0)
            assert completion.token_ids == prompt["greedy_token_ids"]
        client.close()
        pair.processes[0].send_signal(signal.SIGTERM)
        assert pair.wait(timeout=60) == [0, 0], pair.log(0)[-2000:] + pair.log(1)[-2000:]
    finally:
        pair.kill()


def test_killed_follower_ends_the_leader_with_a_clear_error(tmp_path, main_run):
    """SIGKILL process 1 while serving: process 0's health turns NOT_SERVING and it exits (code 3) naming
    the silent process, within peer_timeout and a margin."""
    peer_timeout = 4.0
    pair, grpc_port = _serve_pair(tmp_path, main_run, peer_timeout)
    try:
        pair.processes[1].kill()
        killed = time.monotonic()
        statuses = []
        while pair.processes[0].poll() is None and time.monotonic() - killed < peer_timeout + 30:
            try:
                statuses.append(_health(grpc_port))
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        exited = time.monotonic() - killed
        assert pair.processes[0].poll() == 3, pair.log(0)[-3000:]
        assert exited < peer_timeout + 15
        assert "process 1 stopped answering" in pair.log(0)
        assert NOT_SERVING in statuses
    finally:
        pair.kill()
