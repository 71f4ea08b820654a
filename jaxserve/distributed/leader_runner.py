"""Process 0's runner: ModelRunner's interface, each device call first sent to the followers as a plan.

Every process then issues the same call on the global mesh. A step's sampled tokens come back
replicated on every device (one more small collective on every process), so that process 0 can fetch
rows that data-parallel ranks on other processes sampled. A watchdog thread ends process 0 with a
clear error when a follower stops beating or a step does not complete within peer_timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.distributed.plan import END, EXECUTE, RESET_BUFFERS, PlanSender
from jaxserve.distributed.runtime import Beats, PeerWatch, ProcessGroup

if TYPE_CHECKING:
    from jaxserve.device.runner import StepRunner


def global_inputs(inputs, sharding):
    """Host inputs (the same on every process) as global arrays, each process filling its own shards.
    jax.device_put would do it too, but first compares the values across processes with a collective
    on every call; the plan digests check that more cheaply."""
    return jax.tree.map(
        lambda array: jax.make_array_from_callback(array.shape, sharding, lambda index: array[index]), inputs
    )


def reset_buffers_everywhere(runner, entry: int, token_ids, counts, vocab_size: int, prompt_tokens) -> None:
    """What every follower runs for a RESET_BUFFERS plan (LeaderRunner.reset_sequence_buffers' args)."""
    output_counts = np.zeros(vocab_size, np.int32)
    output_counts[token_ids] = counts
    runner.reset_sequence_buffers(entry, output_counts, prompt_tokens)


def execute_everywhere(runner, mesh, shape, inputs):
    """What every process runs for one step plan: the step over global inputs, its results replicated (the
    prompt logprobs only where some row scores prompt tokens: the host inputs, the same on every process,
    say so alike everywhere)."""
    pending = runner.execute(shape, global_inputs(inputs, runner.input_sharding))
    return replicated_results(pending, mesh, prompt_logprobs=scores_prompt_tokens(inputs))


def scores_prompt_tokens(inputs) -> bool:
    """Whether a step's host inputs (StepInputs, or VerifyInputs around them) score some prompt token."""
    step_inputs = getattr(inputs, "step", inputs)
    return bool((np.asarray(step_inputs.prompt_logprob_targets) >= 0).any())


def replicated_results(pending, mesh, prompt_logprobs: bool = True):
    """The pending step with every result array replicated: addressable on every process. Without
    prompt_logprobs, those stay where the step left them: the engine fetches them only for a step whose rows
    asked (engine.py's scores_prompt), and replicating them is an all-gather of [T, K] scores over the host
    network on every step."""
    replicate = _replicator(mesh)
    arrays = {f.name: getattr(pending, f.name) for f in dataclasses.fields(pending)}
    if not prompt_logprobs:
        del arrays["prompt_logprobs"]
    return dataclasses.replace(
        pending,
        **{
            name: replicate(value)
            for name, value in arrays.items()
            if all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value))
        },
    )


_replicators: dict = {}


def _replicator(mesh):
    if mesh not in _replicators:
        _replicators[mesh] = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))
    return _replicators[mesh]


def allocator_digest(schedulers) -> str:
    """The leader's page allocators in brief: which pages are referenced how often, how many are free."""
    digest = hashlib.blake2b(digest_size=8)
    for scheduler in schedulers:
        allocator = scheduler.allocator
        digest.update(repr((allocator.ref_counts, allocator.num_free_pages)).encode())
    return digest.hexdigest()


class LeaderRunner:
    """Wraps a ModelRunner; everything not overridden here is the inner runner's own."""

    def __init__(self, runner, mesh, schedulers, session: str, group: ProcessGroup):
        self.inner = runner
        self.mesh = mesh
        self.schedulers = schedulers
        self.session = session
        self.group = group
        config = group.config
        self.peer_timeout = config.peer_timeout
        self.plans = PlanSender(session, config.hash_check_interval)
        self.serving = False  # before warm-up ends, every process runs the builder's calls by itself
        self.seconds_sending_plans = 0.0  # for bench/multihost.py
        self._lock = threading.Lock()  # one plan at a time, sent and run in the same order
        self._busy: tuple[str, float] | None = None  # the device call in flight and since when
        self._beats = Beats(group, session, config.beat_interval)
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # -- the inner runner's own, named here because StepRunner asks for them ----------------------

    @property
    def buckets(self):
        return self.inner.buckets

    @property
    def layout(self):
        return self.inner.layout

    @property
    def kv_pages(self):
        return self.inner.kv_pages

    def build_inputs(self, per_rank_chunks, shape):
        return self.inner.build_inputs(per_rank_chunks, shape)

    def params(self):
        return self.inner.params()

    def compiled_buckets(self):
        return self.inner.compiled_buckets()

    def largest_scratch_bytes(self) -> int:
        return self.inner.largest_scratch_bytes()

    def stats(self):
        return self.inner.stats()

    def warm_up_handover_copies(self, max_pages: int) -> None:
        self.inner.warm_up_handover_copies(max_pages)

    # -- the calls every process makes ------------------------------------------------------------

    def warm_up(self, show_progress: bool = True) -> None:
        self.inner.warm_up(show_progress)
        wait_for_every_warm_up(self.group)  # the first step's collectives need every process's executables
        self._start_serving()

    def execute(self, shape, inputs):
        step = self.plans.num_steps
        with self._guard(f"step {step}"):
            self._send(EXECUTE, (shape, inputs))
            pending = execute_everywhere(self.inner, self.mesh, shape, inputs)
        return _WatchedFetch(pending, self, step)

    def run_everywhere(self, op: str, args: tuple, local):
        """Send a plan (op, args) and run its local part here (expert moves, checkpoint saves, buffer resets)."""
        if not self.serving:
            return local()
        with self._guard(op):
            self._send(op, args)
            return local()

    def reset_sequence_buffers(self, entry: int, output_counts: np.ndarray, prompt_tokens: np.ndarray) -> None:
        """The reset is one jit over the global mesh, so every process runs it, though the SequenceBuffers are
        split by rank: only the devices of the entry's data-parallel rank change. The counts [V] go as their
        nonzero entries (a new sequence has none; a resumed one few), the plan staying small for a large
        vocabulary."""
        token_ids = np.flatnonzero(output_counts).astype(np.int32)
        args = (entry, token_ids, output_counts[token_ids], len(output_counts), prompt_tokens)
        self.run_everywhere(
            RESET_BUFFERS, args, lambda: self.inner.reset_sequence_buffers(entry, output_counts, prompt_tokens)
        )

    def replace_params(self, params) -> None:
        if self.serving:
            raise ValueError("on several processes, params change only through plans (expert re-placement)")
        self.inner.replace_params(params)

    def read_pages(self, pages):
        raise ValueError("the host KV tier (swap_space) is not available on several processes yet")

    def write_pages(self, pages, host_pages):
        self.read_pages(pages)

    def warm_up_page_copies(self):
        self.read_pages([])

    def gather_pages(self, pages):
        raise ValueError("prefill/decode disaggregation is not available on several processes yet")

    def scatter_pages(self, pages, chunks):
        self.gather_pages(pages)

    def shutdown(self) -> None:
        """Tell the followers this engine is done (they return from their loop), stop watching."""
        if self.serving and not self._stop.is_set():
            with self._lock:
                self._send(END, ())
            self._stop.set()
            self._beats.stop()
            if self._watchdog is not None and self._watchdog is not threading.current_thread():
                self._watchdog.join(timeout=self.group.config.beat_interval + 5)
        if self.group.active_leader is self:
            self.group.active_leader = None

    # -- plans and the watchdog -------------------------------------------------------------------

    def _send(self, op, args) -> None:
        started = time.perf_counter()
        self.plans.send(op, args, lambda: allocator_digest(self.schedulers))
        self.seconds_sending_plans += time.perf_counter() - started

    def _guard(self, what: str):
        return _Guard(self, what)

    def _start_serving(self) -> None:
        self.serving = True
        self.group.active_leader = self
        self._beats.start()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="jaxserve-leader-watchdog")
        self._watchdog.start()

    def _watch(self) -> None:
        fatal = self.group.fatal
        peers = PeerWatch(self.session, list(range(1, self.group.num_processes)))
        interval = self.group.config.beat_interval
        while not self._stop.wait(interval):
            peer, silent = peers.stalest()
            busy, error = self._busy, peers.reported_error()
            if error is not None:
                fatal(f"{error}; the leader stops")
            elif silent > self.peer_timeout:
                fatal(
                    f"process {peer} stopped answering ({silent:.1f} s without a beat, peer_timeout "
                    f"{self.peer_timeout:g} s): it died or hangs; the leader stops"
                )
            elif busy is not None and time.monotonic() - busy[1] > self.peer_timeout:
                fatal(
                    f"{busy[0]} did not complete within peer_timeout ({self.peer_timeout:g} s): a "
                    "process stopped answering inside a collective; the leader stops"
                )


class _Guard:
    """Marks a device call in flight for the watchdog; holds the plan lock; a runtime error is fatal."""

    def __init__(self, leader: LeaderRunner, what: str, lock: bool = True):
        self.leader, self.what, self.lock = leader, what, lock

    def __enter__(self):
        if self.lock:
            self.leader._lock.acquire()
        self.leader._busy = (self.what, time.monotonic())

    def __exit__(self, kind, error, traceback):
        self.leader._busy = None
        if self.lock:
            self.leader._lock.release()
        if isinstance(error, jax.errors.JaxRuntimeError):
            self.leader.group.fatal(f"{self.what} failed on the devices: {error}")


class _WatchedFetch:
    """A dispatched step whose fetch is watched too: it waits on every process's collectives."""

    def __init__(self, pending, leader: LeaderRunner, step: int):
        self.pending, self.leader, self.step = pending, leader, step

    def __getattr__(self, name):
        return getattr(self.pending, name)

    @property
    def sampled(self):
        return self.pending.sampled

    def fetch(self):
        with _Guard(self.leader, f"fetching step {self.step}", lock=False):
            return self.pending.fetch()

    def fetch_prompt_logprobs(self):
        with _Guard(self.leader, f"fetching step {self.step}'s prompt logprobs", lock=False):
            return self.pending.fetch_prompt_logprobs()


def warm_up(runner, group: ProcessGroup | None, show_progress: bool) -> None:
    """Compile every bucket; on several processes, return once every process has (process 0 waits in
    LeaderRunner.warm_up, before it serves and starts watching the followers' beats)."""
    runner.warm_up(show_progress)
    if group is not None and group.is_multiprocess and not group.is_leader:
        wait_for_every_warm_up(group)


def wait_for_every_warm_up(group: ProcessGroup) -> None:
    """Warm-ups take unequal times: a process whose persistent compilation cache holds the executables (JAX
    writes entries from process 0 only, and a host's cache is its own) loads them in seconds while another
    compiles them. Process 0 serving before the others had finished would watch their beats (which start
    once they follow its plans) and stop the program after peer_timeout."""
    try:
        group.exchange("warm-up done", "")
    except Exception as error:  # the coordination service's timeout, in its own words
        raise RuntimeError(
            f"not every process finished its warm-up within distributed.initialization_timeout "
            f"({group.config.initialization_timeout} s): {error}"
        ) from error


def wrap_runner(runner, mesh, schedulers, group: ProcessGroup | None) -> StepRunner:
    """Process 0 of several: a LeaderRunner; otherwise the runner itself."""
    if group is None or not group.is_multiprocess:
        return runner
    if mesh is None:
        raise ValueError(
            "several processes need a mesh over their devices: set data_parallel_size x "
            "tensor_parallel_size to the number of devices"
        )
    session = group.next_session()  # drawn on every process, in the same order
    if not group.is_leader:
        runner.plan_session = session  # where the follower loop reads this engine's plans
        return runner
    return LeaderRunner(runner, mesh, schedulers, session, group)
