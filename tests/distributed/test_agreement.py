"""Start-up agreement between processes (distributed/agreement.py) without a second process: two
ProcessGroups in threads of this one, over an in-memory stand-in for the coordination service's
key-value store, each building with its own config as two processes started with different files would."""

import threading

import pytest

from jaxserve.config import EngineConfig
from jaxserve.distributed import runtime
from jaxserve.distributed.agreement import agree_on_engine
from jaxserve.distributed.config import DistributedConfig
from jaxserve.loading.model_source import open_model
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.memory_kv import MemoryKeyValueStore


def agree_in_two_processes(monkeypatch, configs: list[EngineConfig]) -> list:
    """What agree_on_engine returned (or raised) in process 0 and process 1."""
    store = MemoryKeyValueStore()
    monkeypatch.setattr(runtime, "client", lambda: store)
    model_config = open_model(fixture_dir("llama_gqa")).config
    settings = DistributedConfig(initialization_timeout=10)
    outcomes: list = [None, None]

    def process(index: int) -> None:
        group = runtime.ProcessGroup(settings, process_index=index, num_processes=2)
        try:
            outcomes[index] = agree_on_engine(configs[index], model_config, group)
        except Exception as error:
            outcomes[index] = error

    threads = [threading.Thread(target=process, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_processes_with_the_same_config_agree_on_the_smallest_kv_budget(monkeypatch):
    config = EngineConfig.from_options(**SMALL_ENGINE)
    outcomes = agree_in_two_processes(monkeypatch, [config, config])
    assert all(isinstance(outcome, EngineConfig) for outcome in outcomes), outcomes
    assert outcomes[0] == outcomes[1] and outcomes[0].cache.kv_cache_memory_gib is not None


@pytest.mark.parametrize("option", [{"num_pages": 64}, {"kv_cache_memory_gib": 0.5}])
def test_a_kv_budget_set_on_one_process_only_is_a_config_mismatch_not_a_timeout(monkeypatch, option):
    """Only process 1 sets its KV budget: process 0 would exchange budgets while process 1 did not, each
    waiting (initialization_timeout, 300 s by default) for a key the other never writes, then failing with
    DEADLINE_EXCEEDED. Both must refuse at once, naming the mismatch."""
    configs = [EngineConfig.from_options(**SMALL_ENGINE), EngineConfig.from_options(**SMALL_ENGINE, **option)]
    outcomes = agree_in_two_processes(monkeypatch, configs)
    for index, outcome in enumerate(outcomes):
        assert isinstance(outcome, ValueError), outcomes
        assert f"process {index}'s engine config and model differs from that of process(es) [{1 - index}]" in str(
            outcome
        )
