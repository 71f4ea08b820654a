"""The penalised requests test_penalties.py serves on one process and on two (penalties_worker.py)."""

from jaxserve import SamplingParams
from tests.support.fixtures import SMALL_ENGINE, expected

ENGINE = SMALL_ENGINE
PENALTIES = [
    dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.5),
    dict(repetition_penalty=2.0),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.2, repetition_penalty=1.2),
]


def generate_rounds(llm) -> list[list[list[int]]]:
    """Greedy tokens of every fixture prompt, penalised, over two rounds: the second's sequences start at
    token buffer entries the first's left (stale counts, another prompt's bitmask) unless each is reset."""
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"]]
    rounds = []
    for shift in range(2):
        params = [
            SamplingParams(max_tokens=24, temperature=0.0, **PENALTIES[(i + shift) % len(PENALTIES)])
            for i in range(len(prompts))
        ]
        outputs = llm.generate(prompts[shift:] + prompts[:shift], params, use_tqdm=False)
        rounds.append([o.outputs[0].token_ids for o in outputs])
    return rounds
