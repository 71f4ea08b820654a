"""Bad input is a clear error at start-up: a malformed config, an unknown or silent replica address, a
replica serving another model."""

import subprocess
import sys

import pytest
import yaml

from jaxserve.router.config import load_router_config, parse_config
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from tests.support.fixtures import fixture_dir
from tests.support.server_harness import ServerProcess

GOOD = {"model": {"path": "tiny-random"}, "replicas": ["127.0.0.1:50051"]}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": None}, "model.path"),
        ({"model": {"path": "x", "dtype": "float32"}}, "model.path"),
        ({"replicas": None}, "exactly one of replicas"),
        ({"launch": {"num_replicas": 2}}, "exactly one of replicas"),
        ({"replicas": ["localhost"]}, "HOST:PORT"),
        ({"replicas": ["localhost:99999"]}, "port in 1..65535"),
        ({"replicas": "127.0.0.1:50051"}, "must be a list"),
        ({"replicas": ["127.0.0.1:1", "127.0.0.1:1"]}, "twice"),
        ({"router": {"polcy": "prefix"}}, "unknown config key router.polcy"),
        ({"router": {"policy": "fastest"}}, "router.policy must be one of prefix, round_robin, least_load, session"),
        ({"router": {"port": "fifty"}}, "router.port must be an integer"),
        ({"router": {"heartbeat": 0}}, "router.heartbeat must be > 0"),
        ({"router": ["policy"]}, "must be a mapping"),
        ({"replicas": None, "launch": {"num_replicas": 0}}, "launch.num_replicas must be a positive integer"),
        ({"replicas": None, "launch": {"num_replicas": 1, "set": "engine.num_pages=8"}}, "KEY=VALUE"),
        ({"replicas": None, "launch": {"num_replicas": 1, "restart": "yes"}}, "launch.restart"),
        ({"extra": 1}, "unknown config section 'extra'"),
        ({"router": {"mode": "split"}}, "router.mode must be one of colocated, disaggregated"),
        ({"prefill_replicas": ["127.0.0.1:2"]}, "need router.mode: disaggregated"),
        ({"router": {"mode": "disaggregated"}}, "takes prefill_replicas and decode_replicas, not replicas"),
        (
            {"router": {"mode": "disaggregated"}, "replicas": None, "prefill_replicas": ["127.0.0.1:2"]},
            "at least one of each",
        ),
        (
            {
                "router": {"mode": "disaggregated"},
                "replicas": None,
                "prefill_replicas": ["127.0.0.1:2"],
                "decode_replicas": ["127.0.0.1:2"],
            },
            "twice",
        ),
        (
            {"router": {"mode": "disaggregated"}, "replicas": None, "launch": {"num_replicas": 2}},
            "num_prefill_replicas >= 1 and num_decode_replicas >= 1",
        ),
        (
            {
                "router": {"mode": "disaggregated"},
                "replicas": None,
                "prefill_replicas": ["127.0.0.1:2"],
                "decode_replicas": ["127.0.0.1:3"],
                "launch": {"num_prefill_replicas": 1, "num_decode_replicas": 1},
            },
            "exactly one of prefill_replicas",
        ),
        ({"replicas": None, "launch": {"num_replicas": 1, "num_decode_replicas": 1}}, "router.mode disaggregated"),
        ({"router": {"resend_wait": 0}}, "router.resend_wait must be > 0"),
    ],
)
def test_a_malformed_config_names_what_is_wrong(change, message):
    tree = {**GOOD, **change}
    with pytest.raises(ValueError, match=message):
        parse_config({key: value for key, value in tree.items() if value is not None})


def test_a_disaggregated_config_reads_both_pools():
    listed = parse_config(
        {
            "model": {"path": "tiny-random"},
            "router": {"mode": "disaggregated"},
            "prefill_replicas": ["127.0.0.1:2"],
            "decode_replicas": ["127.0.0.1:3", "127.0.0.1:4"],
        }
    )
    assert listed.all_replicas == ("127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4") and listed.router.resend_wait == 60.0
    launched = parse_config(
        {
            "model": {"path": "tiny-random"},
            "router": {"mode": "disaggregated"},
            "launch": {"num_prefill_replicas": 1, "num_decode_replicas": 2},
        }
    )
    assert (launched.launch.num_prefill_replicas, launched.launch.num_decode_replicas) == (1, 2)


def test_files_and_overrides(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("model: {path: tiny-random\n")
    with pytest.raises(ValueError, match="malformed YAML"):
        load_router_config(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_router_config(str(tmp_path / "missing.yaml"))
    path.write_text(yaml.safe_dump(GOOD))
    config = load_router_config(str(path), ["router.policy=round_robin", "router.port=0"])
    assert config.router.policy == "round_robin" and config.router.port == 0
    assert load_router_config("configs/router.yaml").launch.num_replicas == 3


def run_router(tmp_path, tree: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(tree))
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.router", "--config", str(path)], capture_output=True, text=True, timeout=120
    )


def test_the_command_line_exits_2_with_the_reason(tmp_path):
    result = run_router(tmp_path, {**GOOD, "router": {"policy": "fastest"}})
    assert result.returncode == 2 and "jaxserve.router: router.policy must be one of" in result.stderr
    result = run_router(
        tmp_path, {"model": {"path": fixture_dir("llama_gqa")}, "replicas": ["no-such-host.invalid:50051"]}
    )
    assert result.returncode == 2 and "replica no-such-host.invalid:50051: unknown host" in result.stderr


def test_a_replica_that_does_not_answer_is_named(tmp_path):
    config = parse_config(
        {
            "model": {"path": fixture_dir("llama_gqa")},
            "replicas": [f"127.0.0.1:{free_port()}"],
            "router": {"port": 0, "startup_timeout": 2},
        }
    )
    with pytest.raises(ValueError, match=r"replica 127.0.0.1:\d+ did not answer GetServerInfo within 2s"):
        RouterServer(config).start()


def test_a_replica_serving_another_model_is_refused(tmp_path):
    replica = ServerProcess(tmp_path, engine={"max_num_seqs": 2})
    try:
        replica.wait_until_serving()
        config = parse_config(
            {
                "model": {"path": fixture_dir("llama_mha_tied")},
                "replicas": [replica.target],
                "router": {"port": 0, "startup_timeout": 30},
            }
        )
        with pytest.raises(ValueError, match=f"replica {replica.target} serves model 'llama_gqa'.*not the router's"):
            RouterServer(config).start()
        same = parse_config(
            {
                "model": {"path": fixture_dir("llama_gqa")},
                "replicas": [replica.target],
                "router": {"port": 0, "startup_timeout": 30},
            }
        )
        router = RouterServer(same)
        router.start()  # the same model from the same files: accepted
        router.stop()
    finally:
        replica.stop()
