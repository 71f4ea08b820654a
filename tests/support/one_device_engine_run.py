"""Run by tests/engine/test_one_device_engine.py with 2 fake CPU devices: llama_gqa with int8 weights on one device
of the two (the default device: no mesh; parallel.device_ids (1,): a mesh of one); prints one JSON line: per engine,
the matmul plan's entries (builder.choose_matmul spied on), the attention implementation, the greedy tokens and
logprobs of a few prompts, and compiles after warm-up."""

from jaxserve import LLM
from jaxserve.engine import builder
from tests.engine.test_one_device_engine import ENGINE, ENGINES, PARAMS, PROMPTS, outputs_of
from tests.support.fake_devices import report_and_exit


def main() -> None:
    plans = []
    choose_matmul = builder.choose_matmul

    def spied(*args, **kwargs):
        plans.append(choose_matmul(*args, **kwargs))
        return plans[-1]

    builder.choose_matmul = spied
    results = {}
    for name, options in ENGINES.items():
        llm = LLM(**ENGINE, **options)
        results[name] = dict(
            plan=[type(entry).__name__ for entry in plans[-1].entries],
            attention=llm.engine.parts.attention.impl,
            outputs=outputs_of(llm.generate(PROMPTS, PARAMS)),
            compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
        )
    report_and_exit(results)


if __name__ == "__main__":
    main()
