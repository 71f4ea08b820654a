"""Penalties on two processes (2 x 4 fake CPU devices, gloo, loopback): the greedy tokens equal one
process's. Each reset of a penalised sequence's token buffer entry is a plan the follower replays; without
it process 1's copy of the counts and prompt bitmasks would differ, and so would the rows its
data-parallel rank samples."""

import json

from jaxserve import LLM, SamplingParams
from tests.distributed.launch import run_workers
from tests.distributed.penalised_requests import ENGINE, generate_rounds
from tests.support.fixtures import expected, fixture_dir


def test_penalised_greedy_tokens_on_two_processes_equal_one(tmp_path):
    codes, logs = run_workers(tmp_path, timeout=420, module="tests.distributed.penalties_worker")
    assert codes == [0, 0] and (tmp_path / "results.json").exists(), (
        f"exit codes {codes}\n--- process 0\n{logs[0][-3000:]}\n--- process 1\n{logs[1][-3000:]}"
    )
    with open(tmp_path / "results.json") as f:
        two_processes = json.load(f)

    llm = LLM(fixture_dir("llama_gqa"), **ENGINE)
    one_process = generate_rounds(llm)
    assert two_processes["rounds"] == one_process
    assert two_processes["stats"]["num_penalty_resets"] > 0
    prompts = expected("llama_gqa")["prompts"]
    plain = llm.generate(
        [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in plain] != one_process[0]  # the penalties change the tokens
