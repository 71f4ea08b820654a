"""Step plans: what process 0 tells the followers to run, in order, so that every process issues the
same computations in the same order.

A plan is an operation name and its arguments (for a step: the StepShape, which picks the compiled
bucket, and the padded host inputs, any pytree of numpy arrays). Plan n is pickled under the key
`<session>/plan/<n // 64>/<n>` of the coordination service's key-value store; followers read the keys
in order. Each process keeps a digest of every plan it ran; every `hash_check_interval` plans the
leader sends its digests with a plan and each follower compares them with its own, so a divergence
becomes an error naming the step instead of a hang or silently different outputs.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve.distributed import runtime

MAX_PLAN_BYTES = 64 << 20
PLANS_PER_BLOCK = 64  # plans are keyed <session>/plan/<block>/<n>, deleted a block at a time
EXECUTE, REBALANCE, SAVE, END = "execute", "rebalance", "save", "end"
RESET_BUFFERS = "reset_sequence_buffers"  # a penalised sequence's entry in the device's SequenceBuffers


@dataclass
class Plan:
    op: str
    args: tuple
    seq: int = 0  # the plan's place in the stream
    step: int = 0  # execute plans sent before this one: what an error names
    check: list[bytes] | None = field(default=None)  # the leader's digests of the plans since the last check
    leader_state: str = ""  # a digest of the leader's page allocators, folded into this plan's digest


def plan_digest(plan: Plan) -> bytes:
    """A digest of what a plan makes a process run: its op, the args' structure and every array's bytes."""
    digest = hashlib.blake2b(digest_size=16)
    leaves, treedef = jax.tree.flatten(plan.args)
    digest.update(f"{plan.seq}:{plan.op}:{treedef}:{plan.leader_state}".encode())
    for leaf in leaves:
        if isinstance(leaf, (np.ndarray, np.generic)):
            array = np.ascontiguousarray(leaf)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(array.tobytes())
        else:
            digest.update(repr(leaf).encode())
    return digest.digest()


def plan_key(prefix: str, seq: int) -> str:
    return f"{prefix}/{seq // PLANS_PER_BLOCK}/{seq}"


class DivergenceError(RuntimeError):
    pass


class DigestWindow:
    """The digests of the plans run since the last check."""

    def __init__(self, interval: int):
        self.interval = interval
        self.digests: list[bytes] = []
        self.first_seq = 0
        self.first_step = 0

    def record(self, plan: Plan, digest: bytes) -> None:
        if not self.digests:
            self.first_seq, self.first_step = plan.seq, plan.step
        self.digests.append(digest)

    def due(self) -> bool:
        return bool(self.interval) and len(self.digests) >= self.interval

    def take(self) -> list[bytes]:
        digests, self.digests = self.digests, []
        return digests

    def compare(self, leader_digests: list[bytes], steps: list[int]) -> None:
        """Raise DivergenceError naming the first plan whose digest differs from the leader's."""
        mine = self.take()
        for index, (own, leader) in enumerate(zip(mine, leader_digests)):
            if own != leader:
                raise DivergenceError(
                    f"plans diverged at step {steps[index]} (plan {self.first_seq + index}): process "
                    f"{jax.process_index()} ran a different plan than process 0 sent; stopping every process"
                )
        if len(mine) != len(leader_digests):
            raise DivergenceError(
                f"plans diverged after step {self.first_step}: process {jax.process_index()} ran "
                f"{len(mine)} plans where process 0 sent {len(leader_digests)}"
            )


class PlanSender:
    """Process 0's end: numbered plans into the key-value store, digests recorded as sent."""

    def __init__(self, session: str, interval: int):
        self.key = f"{session}/plan"
        self.window = DigestWindow(interval)
        self.seq = 0
        self.num_steps = 0

    def send(self, op: str, args: tuple, leader_state=lambda: "") -> Plan:
        plan = Plan(op, args, seq=self.seq, step=self.num_steps)
        if self.window.due() or op == END:
            plan.check = self.window.take()
            plan.leader_state = leader_state()
        self.window.record(plan, plan_digest(plan))
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > MAX_PLAN_BYTES:
            raise ValueError(f"a {op} plan of {len(payload)} bytes exceeds {MAX_PLAN_BYTES}")
        kv = runtime.client()
        kv.key_value_set_bytes(plan_key(self.key, self.seq), payload)
        if self.seq % PLANS_PER_BLOCK == 0 and self.seq >= 2 * PLANS_PER_BLOCK:
            # followers are in lockstep through the steps' collectives: the block before last is read
            kv.key_value_delete(f"{self.key}/{self.seq // PLANS_PER_BLOCK - 2}")
        self.seq += 1
        self.num_steps += op == EXECUTE
        return plan


class PlanReceiver:
    """A follower's end: the next plan, waiting at most `timeout` seconds (None on timeout)."""

    def __init__(self, session: str, interval: int):
        self.key = f"{session}/plan"
        self.window = DigestWindow(interval)
        self.steps: list[int] = []
        self.seq = 0

    def receive(self, timeout: float) -> Plan | None:
        try:
            payload = runtime.client().blocking_key_value_get_bytes(plan_key(self.key, self.seq), int(timeout * 1000))
        except Exception as error:
            if "DEADLINE_EXCEEDED" in str(error) or "timed out" in str(error).lower():
                return None
            raise
        self.seq += 1
        return pickle.loads(payload)

    def record(self, plan: Plan) -> None:
        """After the plan ran as given (or as perturbed by a test): check the window it closes, record it."""
        if plan.check is not None:
            self.window.compare(plan.check, self.steps)
            self.steps = []
        self.window.record(plan, plan_digest(plan))
        self.steps.append(plan.step)
