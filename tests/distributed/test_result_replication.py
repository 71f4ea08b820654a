"""What the leader replicates of a step's results (leader_runner.execute_everywhere), on one process of 4 fake
CPU devices (dp 2 x tp 2): a step that scores no prompt token leaves its prompt-logprob arrays where the step
wrote them (across processes, replicating them is an all-gather of [T, K] scores over the host network each
step); a step that scores some replicates them, and the prompt logprobs served are the plain steps'."""

from tests.support.fake_devices import run_on_fake_devices


def test_prompt_logprobs_move_only_when_a_row_asked():
    outcome = run_on_fake_devices("tests.distributed.replication_run", devices=4)
    steps = outcome["steps"]
    assert any(step["scores"] for step in steps) and not all(step["scores"] for step in steps), steps
    for step in steps:
        if step["scores"]:
            assert step["replicated"] and not step["unmoved"], step
        else:
            assert step["unmoved"], step
    assert outcome["scored_prompts"] > 0
    assert outcome["tokens_equal"] and outcome["prompt_logprobs_equal"]
