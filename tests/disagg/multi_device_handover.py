"""Run as a subprocess by test_multi_device.py with 8 fake CPU devices: a prefill engine and a decode
engine on disjoint devices and different meshes, pages moved with jax.device_put. Prints JSON."""

import json
import sys

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.disagg.handover import DisaggregatedPair
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
results = {"num_devices": len(jax.devices())}
prompts = expected("llama_gqa")["prompts"]
for run in sys.argv[1:]:  # prefill_tp:prefill_devices/decode_tp:decode_devices, devices as 0-1
    sides = []
    for side, role in zip(run.split("/"), ("prefill", "decode")):
        tp, devices = side.split(":")
        first, last = map(int, devices.split("-"))
        sides.append(
            LLM(
                fixture_dir("llama_gqa"),
                role=role,
                tensor_parallel_size=int(tp),
                device_ids=tuple(range(first, last + 1)),
                **SMALL_ENGINE,
            ).engine
        )
    pair = DisaggregatedPair(*sides)
    outputs = pair.generate([p["token_ids"] for p in prompts], GREEDY)
    results[run] = {
        "greedy_equal": [
            o.outputs[0].token_ids == p["greedy_token_ids"][: len(o.outputs[0].token_ids)]
            and len(o.outputs[0].token_ids) in (12, len(p["greedy_token_ids"]))
            for o, p in zip(outputs, prompts)
        ],
        "devices": [sorted(d.id for d in e.runner.kv_pages.keys[0].sharding.device_set) for e in sides],
        "num_handovers": pair.stats.num_handovers,
        "bytes_moved": pair.stats.bytes_moved,
        "pages_free": [e.stats()["kv_pages_free"] == e.stats()["kv_pages_total"] for e in sides],
    }
print(json.dumps(results))
