"""Run by tests/engine/test_kv_budget_meshes.py with 4 fake CPU devices: llama_gqa under one KV budget
(kv_cache_memory_gib, one device's memory) on one device, tensor parallel 2, and data x tensor parallel 2 x 2;
prints one JSON line: per mesh, the pages per rank and the most KV bytes any one device holds."""

import collections

import jax

from jaxserve import LLM
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

BUDGET_GIB = 2**-11  # 512 KiB: below what max_num_seqs full-length sequences would use, so the budget binds
MESHES = {
    "one": {},
    "tp2": {"tensor_parallel_size": 2},
    "dp2_tp2": {"data_parallel_size": 2, "tensor_parallel_size": 2},
}


def main() -> None:
    results = {}
    for name, options in MESHES.items():
        llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "kv_cache_memory_gib": BUDGET_GIB, **options})
        per_device = collections.Counter()
        for leaf in jax.tree.leaves(llm.engine.runner.kv_pages):
            for shard in leaf.addressable_shards:
                per_device[shard.device.id] += shard.data.nbytes
        results[name] = dict(
            pages_per_rank=llm.engine.runner.layout.pages_per_rank,
            max_device_bytes=max(per_device.values()),
            budget_bytes=int(BUDGET_GIB * 2**30),
        )
    report_and_exit(results)


if __name__ == "__main__":
    main()
