"""A follower process's loop: read process 0's plans in order and run each on the global mesh, until
process 0 ends the engine. Followers schedule nothing; they hold the same params and KV pages'
shards and run the same executables, so the step's collectives meet.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxserve.distributed.leader_runner import execute_everywhere, reset_buffers_everywhere
from jaxserve.distributed.plan import (
    END,
    EXECUTE,
    REBALANCE,
    RESET_BUFFERS,
    SAVE,
    DivergenceError,
    Plan,
    PlanReceiver,
)
from jaxserve.distributed.runtime import Beats, PeerWatch, ProcessGroup

logger = logging.getLogger(__name__)


def run_follower(parts, group: ProcessGroup, perturb_step: int | None = None) -> None:
    """Run the plans of the engine `parts` (builder.EngineParts, built exactly as on process 0 with the
    same group) until process 0 ends it. perturb_step (tests only): change that step's token ids, a
    divergence to catch."""
    config = group.config
    session = parts.runner.plan_session
    receiver = PlanReceiver(session, config.hash_check_interval)
    beats = Beats(group, session, config.beat_interval)
    beats.start()
    leader = PeerWatch(session, [0])
    try:
        while True:
            plan = receiver.receive(config.beat_interval)
            if plan is None:
                _check_leader(group, leader, config.peer_timeout)
                continue
            if perturb_step is not None and plan.op == EXECUTE and plan.step == perturb_step:
                _perturb(plan)
            receiver.record(plan)
            if plan.op == END:
                return
            _run(parts, group, plan)
    except DivergenceError as error:
        group.report_and_stop(session, str(error))
    except Exception as error:  # a follower that cannot run a plan must not leave the others waiting
        logger.exception("follower failed")
        group.report_and_stop(session, f"could not run a plan: {type(error).__name__}: {error}")
    finally:
        beats.stop()


def _check_leader(group: ProcessGroup, leader: PeerWatch, peer_timeout: float) -> None:
    _, silent = leader.stalest()
    if silent > peer_timeout:
        group.fatal(f"process 0 stopped answering ({silent:.1f} s without a beat): the follower stops")


def _run(parts, group: ProcessGroup, plan: Plan) -> None:
    if plan.op == EXECUTE:
        shape, inputs = plan.args
        execute_everywhere(parts.runner, parts.mesh, shape, inputs)
    elif plan.op == RESET_BUFFERS:
        reset_buffers_everywhere(parts.runner, *plan.args)
    elif plan.op == REBALANCE:
        parts.experts.apply(*plan.args)
    elif plan.op == SAVE:
        from jaxserve.loading.orbax_checkpoint import write_checkpoint

        write_checkpoint(parts.runner.params(), *plan.args, group=group)
    else:
        group.fatal(f"unknown plan {plan.op!r} at step {plan.step}: is every process running the same jaxserve?")


def _perturb(plan: Plan) -> None:
    shape, inputs = plan.args
    inputs.token_ids = np.asarray(inputs.token_ids).copy()
    inputs.token_ids[0] += 1
    logger.warning("test hook: perturbed step %d's token ids", plan.step)
