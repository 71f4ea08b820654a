"""Run as a subprocess by tests/sharding/test_sequence_buffers_split.py, with fake CPU devices set up before JAX
starts. For each mesh given as dp:tp: an engine over llama_gqa serving penalised greedy requests over two rounds
(tests/distributed/penalised_requests.py: the second round's sequences reuse the first's token buffer entries),
and where its sequence buffers sit: each array's bytes on the device holding the most of it, and its whole
size. The same requests on one device first. Prints one JSON object."""

import sys

import jax

from jaxserve import LLM
from tests.distributed.penalised_requests import ENGINE, generate_rounds
from tests.support.fake_devices import report_and_exit, results_per_case
from tests.support.fixtures import fixture_dir


def placement(llm) -> dict:
    buffers = llm.engine.runner.buffers
    return {
        name: dict(
            most=max(shard.data.nbytes for shard in array.addressable_shards),
            whole=array.nbytes,
            spec=[str(axis) for axis in array.sharding.spec],
        )
        for name, array in vars(buffers).items()
    }


def run(mesh: str) -> dict:
    data, tensor = (int(size) for size in mesh.split(":"))
    llm = LLM(fixture_dir("llama_gqa"), **ENGINE, data_parallel_size=data, tensor_parallel_size=tensor)
    return dict(
        rounds=generate_rounds(llm),
        buffers=placement(llm),
        compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
    )


results = dict(num_devices=len(jax.devices()), one_device=generate_rounds(LLM(fixture_dir("llama_gqa"), **ENGINE)))
results.update(results_per_case(run, sys.argv[1:]))
report_and_exit(results)
