"""The multi-host pieces that need no second process: the config section, plan digests and the check
that names the step where plans diverged, and how a fatal error ends a process (health first)."""

import numpy as np
import pytest

from jaxserve.device.step_inputs import StepShape
from jaxserve.distributed import runtime
from jaxserve.distributed.config import DistributedConfig
from jaxserve.distributed.plan import EXECUTE, DigestWindow, DivergenceError, Plan, plan_digest
from jaxserve.server.config_file import load_config


def test_distributed_config_section(tmp_path):
    assert load_config(None, []).distributed is None  # one process
    (tmp_path / "slice.yaml").write_text("distributed: {}\n")  # a TPU slice: jax.distributed detects the rest
    assert load_config(str(tmp_path / "slice.yaml")).distributed == DistributedConfig()
    config = load_config(
        None,
        [
            "distributed.coordinator_address=10.0.0.1:1234",
            "distributed.num_processes=2",
            "distributed.process_id=1",
            "distributed.peer_timeout=5",
        ],
    ).distributed
    assert (config.coordinator_address, config.num_processes, config.process_id) == ("10.0.0.1:1234", 2, 1)
    assert config.beat_interval < config.peer_timeout
    assert load_config(None, ["distributed.peer_timeout=60"]).distributed.coordinator_address is None  # auto-detect
    with pytest.raises(ValueError, match="together"):
        DistributedConfig(coordinator_address="h:1", num_processes=2)
    with pytest.raises(ValueError, match="process_id"):
        DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="peer_timeout"):
        DistributedConfig(peer_timeout=0)
    with pytest.raises(ValueError, match="unknown config key distributed.bogus"):
        load_config(None, ["distributed.bogus=1"])


def _plan(seq, token_ids, step=None):
    inputs = {"token_ids": np.asarray(token_ids, np.int32), "positions": np.arange(len(token_ids), dtype=np.int32)}
    return Plan(EXECUTE, (StepShape(8, 8, 4, 1), inputs), seq=seq, step=seq if step is None else step)


def test_plan_digest_covers_shape_and_every_array():
    assert plan_digest(_plan(0, [1, 2, 3])) == plan_digest(_plan(0, [1, 2, 3]))
    assert plan_digest(_plan(0, [1, 2, 3])) != plan_digest(_plan(0, [1, 2, 4]))
    assert plan_digest(_plan(0, [1, 2, 3])) != plan_digest(_plan(1, [1, 2, 3]))  # its place in the stream
    other_bucket = _plan(0, [1, 2, 3])
    other_bucket.args = (StepShape(16, 16, 4, 1), other_bucket.args[1])
    assert plan_digest(other_bucket) != plan_digest(_plan(0, [1, 2, 3]))


def test_digest_window_names_the_first_step_that_differs():
    leader, follower = DigestWindow(4), DigestWindow(4)
    for seq in range(4):
        leader.record(_plan(seq, [seq]), plan_digest(_plan(seq, [seq])))
        ran = _plan(seq, [seq + (seq >= 2)])  # this follower ran steps 2 and 3 differently
        follower.record(ran, plan_digest(ran))
    assert leader.due()
    with pytest.raises(DivergenceError, match="diverged at step 2 \\(plan 2\\)"):
        follower.compare(leader.take(), [0, 1, 2, 3])
    same = DigestWindow(4)
    same.record(_plan(0, [5]), plan_digest(_plan(0, [5])))
    same.compare([plan_digest(_plan(0, [5]))], [0])  # equal: no error
    short = DigestWindow(4)
    with pytest.raises(DivergenceError, match="ran 0 plans where process 0 sent 1"):
        short.compare([b"x"], [])


def test_fatal_turns_health_first_then_exits(monkeypatch, capsys):
    events = []
    monkeypatch.setattr(runtime, "FATAL_GRACE_SECONDS", 0.0)
    group = runtime.ProcessGroup(DistributedConfig(), process_index=1, num_processes=2)
    group.exit = lambda code: events.append(("exit", code))  # os._exit would end pytest
    group.on_fatal(lambda: events.append("NOT_SERVING"))
    group.on_fatal(lambda: 1 / 0)  # a failing hook does not stop the exit
    with pytest.raises(SystemExit):  # where the exit returns (only here), fatal still does not
        group.fatal("process 1 stopped answering")
    assert events == ["NOT_SERVING", ("exit", runtime.FATAL_EXIT_CODE)]
    assert "process 1 stopped answering" in capsys.readouterr().err


def test_a_process_group_owns_its_sessions_hooks_and_leader():
    """What used to be module globals is each group's own: two groups draw sessions from their own
    counters (every process draws in the same order), and one's hooks or leader are not the other's."""
    first, second = (runtime.ProcessGroup(DistributedConfig(), process_index=0, num_processes=2) for _ in range(2))
    assert [first.next_session(), first.next_session(), second.next_session()] == [
        "jaxserve/0",
        "jaxserve/1",
        "jaxserve/0",
    ]
    first.on_fatal(lambda: None)
    assert len(first.fatal_hooks) == 1 and second.fatal_hooks == [] and first.active_leader is None
    assert first.is_leader and first.is_multiprocess and runtime.spans_processes(first)
    alone = runtime.ProcessGroup(DistributedConfig(), process_index=0, num_processes=1)
    assert not runtime.spans_processes(alone) and not runtime.spans_processes(None)
    assert runtime.initialize(None) is None  # no distributed section: one process, nothing joined
