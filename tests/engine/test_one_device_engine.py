"""An engine on one device of a process that holds several (a single-device engine on a multi-GPU host; fake CPU
devices) runs the one-device kernels, as in a process with one device: the matmul plan was chosen by the process's
device count, so such an engine lost the CPU kernels (on a GPU host, the Pallas quantized kernel): with int8 weights
its greedy tokens differed from the same engine's in a one-device process, and its logprobs moved by ulps with the
step's rows (XLA's dots; LoRA with speculation on). The engines (the default device: no mesh; parallel.device_ids
(1,): a mesh of one) run in a subprocess with 2 fake CPU devices; their outputs equal this process's one-device
engine's to the bit (a mesh of one partitions nothing: its attention is the C++ kernel too, not the reference)."""

import pytest

from jaxserve import LLM, SamplingParams
from tests.support.fake_devices import run_on_fake_devices
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

ENGINE = dict(model=fixture_dir("llama_gqa"), **SMALL_ENGINE, quantization="int8", page_size=4, num_pages=64)
PROMPTS = [[5, 6, 7, 8] * 4, list(range(20, 45)), [9, 10, 11] * 3]

# the subprocess's engines, each against this process's engine of the same options
ENGINES = {"default_device": {}, "device_1": {"device_ids": (1,)}}
HERE = {"default_device": {}, "device_1": {}}
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1)


def outputs_of(results) -> list:
    """Tokens, logprobs and prompt logprobs as JSON data (floats kept exactly: JSON round-trips them)."""
    return [
        [
            result.outputs[0].token_ids,
            [{str(k): float(v) for k, v in entry.items()} for entry in result.outputs[0].logprobs],
            [
                None if entry is None else {str(k): float(v) for k, v in entry.items()}
                for entry in result.prompt_logprobs
            ],
        ]
        for result in results
    ]


@pytest.fixture(scope="module")
def results():
    # its outputs are compared bit for bit with this process's engine: the serving CPU's code generation
    return run_on_fake_devices("tests.support.one_device_engine_run", devices=2, serving_codegen=True)


def test_an_engine_on_one_of_several_devices_keeps_the_one_device_kernels(results):
    for name, got in results.items():
        assert "SmallMatmul" in got["plan"] and "QuantizedSmallMatmul" in got["plan"], (name, got["plan"])
        assert got["attention"] == "cpu", (name, got["attention"])  # the C++ kernel, not the partitioned reference
        assert got["compiles_after_warmup"] == 0


@pytest.mark.parametrize("name", list(ENGINES))
def test_its_outputs_equal_a_one_device_process(results, name):
    assert results[name]["outputs"] == outputs_of(LLM(**ENGINE, **HERE[name]).generate(PROMPTS, PARAMS))
