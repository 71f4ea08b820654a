"""The `distributed` section: how this process joins a multi-controller JAX program (jax.distributed)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config_types import check_field_types


@dataclass(frozen=True)
class DistributedConfig:
    """Process 0 (the leader) schedules and serves; every other process (a follower) runs its plans.

    With coordinator_address, num_processes and process_id all unset, jax.distributed.initialize()
    detects them itself (TPU slices, SLURM, Kubernetes with the JobSet / Open MPI conventions)."""

    coordinator_address: str | None = None  # host:port of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # this process's devices (GPU: one process per node)
    num_cpu_devices: int | None = None  # CPU only (tests, bench): fake devices per process
    # A process that dies or stops answering ends the leader (health NOT_SERVING first) within this long.
    peer_timeout: float = 60.0
    # Every this many plans, the processes compare the digests of the plans each ran (0: never).
    hash_check_interval: int = 16
    initialization_timeout: int = 300  # seconds every process waits for the others to join

    def __post_init__(self):
        check_field_types(self, "distributed")
        given = [self.coordinator_address is not None, self.num_processes is not None, self.process_id is not None]
        if any(given) and not all(given):
            raise ValueError(
                "distributed needs coordinator_address, num_processes and process_id together "
                "(or none of them, to auto-detect on a TPU slice, SLURM or Kubernetes)"
            )
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1, got {self.num_processes}")
        if (
            self.process_id is not None
            and self.num_processes is not None
            and not 0 <= self.process_id < self.num_processes
        ):
            raise ValueError(f"distributed.process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if not self.peer_timeout > 0:
            raise ValueError(f"distributed.peer_timeout must be > 0 seconds, got {self.peer_timeout}")
        if self.num_cpu_devices is not None and self.num_cpu_devices < 1:
            raise ValueError(f"distributed.num_cpu_devices must be >= 1, got {self.num_cpu_devices}")
        if self.local_device_ids is not None:
            object.__setattr__(self, "local_device_ids", tuple(int(i) for i in self.local_device_ids))

    @property
    def beat_interval(self) -> float:
        """How often each process proves it is alive: several beats fit in a timeout."""
        return min(max(self.peer_timeout / 8, 0.05), 5.0)
