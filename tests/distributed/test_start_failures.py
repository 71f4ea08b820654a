"""Multi-host start-up failures (issue 23, item 12) with `python -m jaxserve.serve` as processes 0 and 1 on
loopback (2 x 4 fake CPU devices, gloo): a mesh that leaves a process without devices is refused on
every process with an error naming the sizes, and a follower that cannot start stops process 0 too,
which exits with that error instead of serving. Every wait is bounded; both processes are killed in the end."""

import sys

import yaml

from tests.distributed.launch import ProcessPair, free_port
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

EXIT_WITHIN = 180  # seconds: two JAX processes start on a loaded 2-core machine


def start_pair(tmp_path, engine: dict, model_paths: tuple[str, str]) -> ProcessPair:
    coordinator = free_port()
    paths = []
    for process_id in range(2):
        config = {
            "model": {"path": model_paths[process_id], "dtype": "float32"},
            "engine": {
                **{k: v for k, v in SMALL_ENGINE.items() if k != "dtype"},
                "decode_seq_buckets": list(SMALL_ENGINE["decode_seq_buckets"]),  # yaml.safe_dump refuses tuples
                **engine,
            },
            "server": {"port": free_port(), "http_port": 0, "metrics_port": 0},
            "distributed": {
                "coordinator_address": f"127.0.0.1:{coordinator}",
                "num_processes": 2,
                "process_id": process_id,
                "num_cpu_devices": 4,
                "peer_timeout": 30.0,
                "initialization_timeout": 60,
            },
        }
        paths.append(tmp_path / f"process{process_id}.yaml")
        paths[-1].write_text(yaml.safe_dump(config))
    return ProcessPair(tmp_path, lambda i: [sys.executable, "-m", "jaxserve.serve", "--config", str(paths[i])])


def test_a_mesh_leaving_a_process_without_devices_is_refused_on_every_process(tmp_path):
    """data_parallel_size 2 x tensor_parallel_size 2 uses 4 of the 8 devices, all of process 0's."""
    model = fixture_dir("llama_gqa")
    pair = start_pair(tmp_path, {"data_parallel_size": 2, "tensor_parallel_size": 2}, (model, model))
    try:
        codes = pair.wait(EXIT_WITHIN)
        logs = [pair.log(0), pair.log(1)]
        assert None not in codes and 0 not in codes, f"exit codes {codes}\n{logs[0][-2000:]}\n{logs[1][-2000:]}"
        for log in logs:
            assert "data_parallel_size 2 x tensor_parallel_size 2 uses 4 device(s)" in log, log[-2000:]
            assert "process(es) [1] would hold none" in log
            assert "Traceback" not in log
        assert "serving" not in logs[0].lower().split("warming up")[-1]
    finally:
        pair.kill()


def test_a_follower_that_cannot_start_stops_process_0(tmp_path):
    """Process 1 is given a model directory that does not exist: process 0, waiting for it to agree on
    the engine, exits (code 3) naming process 1 and its error."""
    missing = str(tmp_path / "no-such-model")
    pair = start_pair(tmp_path, {"tensor_parallel_size": 8}, (fixture_dir("llama_gqa"), missing))
    try:
        codes = pair.wait(EXIT_WITHIN)
        log = pair.log(0)
        assert codes[1] not in (None, 0), pair.log(1)[-2000:]
        assert codes[0] == 3, f"exit codes {codes}\n{log[-3000:]}"
        assert "process 1 could not start" in log and "no-such-model" in log, log[-2000:]
    finally:
        pair.kill()


def test_processes_reading_different_weights_are_refused_naming_the_weight(tmp_path):
    """Weights are placed shard by shard from each process's own copy (jax.device_put would gather each whole
    weight from every process to compare them); a checksum is compared instead, so a process whose checkpoint
    differs (here one value of one tensor) is still refused on every process, naming the tensor."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    changed = tmp_path / "llama_gqa_changed"
    shutil.copytree(fixture_dir("llama_gqa"), changed)
    tensors = load_file(str(changed / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] += np.float32(1.0)
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    pair = start_pair(tmp_path, {"tensor_parallel_size": 8}, (fixture_dir("llama_gqa"), str(changed)))
    try:
        codes = pair.wait(EXIT_WITHIN)
        logs = [pair.log(0), pair.log(1)]
        assert None not in codes and 0 not in codes, f"exit codes {codes}\n{logs[0][-2000:]}\n{logs[1][-2000:]}"
        assert any("differs between the processes" in log and "down_proj" in log for log in logs), logs[0][-3000:]
    finally:
        pair.kill()
