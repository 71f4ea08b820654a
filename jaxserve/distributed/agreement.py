"""Before the KV cache is sized: every process must build the same engine. Options that are not
available on several processes are refused, the KV budget is the smallest any process can afford, and
the config and model must be the same everywhere (else the first collective would hang)."""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.config import EngineRole
from jaxserve.device.runner import kv_cache_bytes_available
from jaxserve.distributed.runtime import ProcessGroup, RefusedOnEveryProcess, spans_processes


def check_every_process_holds_devices(mesh, parallel, group: ProcessGroup | None) -> None:
    """Several processes: each must hold devices of the mesh, else it has no part of any step to run
    (its follower loop would fail at the first plan while process 0 served alone). The mesh is the same
    on every process, so every process refuses it alike, before anything is placed on a device."""
    if not spans_processes(group):
        return
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    used = {device.process_index for device in devices}
    missing = [process for process in range(jax.process_count()) if process not in used]
    if missing:
        local = [sum(1 for d in jax.devices() if d.process_index == p) for p in range(jax.process_count())]
        raise RefusedOnEveryProcess(
            f"data_parallel_size {parallel.data_parallel_size} x tensor_parallel_size "
            f"{parallel.tensor_parallel_size} uses {len(devices)} device(s), all on process(es) {sorted(used)}; "
            f"the {jax.process_count()} processes hold {jax.device_count()} devices ({local} per process), so "
            f"process(es) {missing} would hold none. Every process must hold devices of the mesh: make "
            f"data_parallel_size x tensor_parallel_size {jax.device_count()} (every device)"
        )


def agree_on_engine(config, model_config, group: ProcessGroup | None):
    """The EngineConfig every process builds with (unchanged on one process)."""
    if group is None or not group.is_multiprocess:
        return config
    if config.cache.swap_space:
        raise ValueError("swap_space (the host KV tier) is not available on several processes yet")
    if config.disagg.role != EngineRole.BOTH:
        raise ValueError("prefill/decode disaggregation (role) is not available on several processes yet")
    # Agree first, on the config as given: an exchange that only some processes make (the KV budget's, where
    # one process sets num_pages) would leave every process waiting for keys the others never write.
    described = dataclasses.replace(config, show_progress=False)
    group.agree_across_processes("engine config and model", f"{described!r} {model_config!r} {jax.device_count()}")
    if config.cache.num_pages is None and config.cache.kv_cache_memory_gib is None:
        budgets = group.exchange("kv_budget", str(kv_cache_bytes_available(None)))  # (this process's device)
        config = config.with_options(kv_cache_memory_gib=min(int(b) for b in budgets) / 2**30)
    return config


def expert_balancer_type(default: type, group: ProcessGroup | None) -> type:
    """The builder's ExpertBalancer, or on several processes one whose moves travel as plans."""
    if not spans_processes(group):
        return default
    from jaxserve.distributed.experts import DistributedExpertBalancer  # imports the engine package

    return DistributedExpertBalancer
