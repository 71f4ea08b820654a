"""Process 0 serves only once every process has warmed up: a follower still compiling (its persistent cache
cold where process 0's is warm: JAX writes entries from process 0 only) does not beat yet, and process 0's
watchdog would stop the program after peer_timeout. Two ProcessGroups in threads of this process, over an
in-memory key-value store; the runners' warm-ups are stand-ins that take the time they are given."""

import threading
import time

from jaxserve.distributed import runtime
from jaxserve.distributed.config import DistributedConfig
from jaxserve.distributed.leader_runner import LeaderRunner, warm_up
from tests.support.memory_kv import MemoryKeyValueStore


class CompilingRunner:
    def __init__(self, seconds: float):
        self.seconds, self.warmed_up_at = seconds, None

    def warm_up(self, show_progress: bool = True) -> None:
        time.sleep(self.seconds)
        self.warmed_up_at = time.monotonic()


def test_process_0_starts_serving_after_every_process_warmed_up(monkeypatch):
    store = MemoryKeyValueStore()
    monkeypatch.setattr(runtime, "client", lambda: store)
    served_at = []
    monkeypatch.setattr(LeaderRunner, "_start_serving", lambda self: served_at.append(time.monotonic()))
    settings = DistributedConfig(initialization_timeout=30)
    groups = [runtime.ProcessGroup(settings, process_index=index, num_processes=2) for index in range(2)]
    cached, compiling = CompilingRunner(0.0), CompilingRunner(1.5)  # process 0 loads, process 1 compiles
    leader = LeaderRunner(cached, None, [], groups[0].next_session(), groups[0])
    threads = [
        threading.Thread(target=warm_up, args=(leader, groups[0], False)),
        threading.Thread(target=warm_up, args=(compiling, groups[1], False)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert compiling.warmed_up_at is not None and len(served_at) == 1
    assert served_at[0] >= compiling.warmed_up_at
