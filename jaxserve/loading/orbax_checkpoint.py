"""Orbax checkpoints of a loaded model: saved from any mesh, restored straight onto any other.

A jaxserve checkpoint directory holds the Hugging Face files that describe the model (config.json,
tokenizer files) beside `params/` (orbax) and `jaxserve_checkpoint.json`, so `LLM(directory)` opens
it like a Hugging Face directory. Each param is restored directly into the sharding the restoring
engine's rules give it.

On several processes (jaxserve.distributed) every process writes and reads its own shards: process 0
sends the save to the followers as a plan, each writes its shards into the same directory (shared
storage: GCS, NFS), and only process 0 writes the description files. Such a checkpoint restores
onto any mesh, one process included.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flax import nnx

    from jaxserve.distributed.runtime import ProcessGroup

# jax and flax are imported by the functions that use them: model_source asks whether a directory is a
# checkpoint (is_orbax_checkpoint) in the router's process too, which must not load JAX.

MARKER = "jaxserve_checkpoint.json"
DESCRIPTION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def is_orbax_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MARKER))


def checkpoint_dtype(directory: str) -> str:
    with open(os.path.join(directory, MARKER)) as f:
        return json.load(f)["dtype"]


def _flat(state: nnx.State) -> dict:
    from flax import nnx

    return {".".join(map(str, path)): variable.get_value() for path, variable in nnx.to_flat_state(state)}


def save_checkpoint(
    params: nnx.State, dtype: str, source_dir: str, directory: str, group: ProcessGroup | None = None
) -> None:
    """params as the runner holds them (experts in their placed rows) or already canonical; group: the
    engine's processes (None: one)."""
    from jaxserve.distributed.plan import SAVE

    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, "params")):
        raise ValueError(f"{directory} already holds a checkpoint")
    leader = group.active_leader if group is not None else None
    if leader is None:
        write_checkpoint(params, dtype, source_dir, directory, group=group)
    else:  # every process writes its own shards
        leader.run_everywhere(
            SAVE,
            (dtype, source_dir, directory),
            lambda: write_checkpoint(params, dtype, source_dir, directory, group=group),
        )


def write_checkpoint(
    params: nnx.State, dtype: str, source_dir: str, directory: str, group: ProcessGroup | None = None
) -> None:
    import jax

    from jaxserve.distributed.experts import canonical_everywhere
    from jaxserve.distributed.runtime import spans_processes
    from sharding.expert_placement import canonical_params

    params = canonical_everywhere(params) if spans_processes(group) else canonical_params(params)
    writes_description = jax.process_index() == 0
    if writes_description:
        os.makedirs(directory, exist_ok=True)
        for name in DESCRIPTION_FILES:
            if os.path.isfile(os.path.join(source_dir, name)):
                shutil.copy(os.path.join(source_dir, name), directory)
    import orbax.checkpoint as ocp  # imported when used: it is slow to import and claims the root logger

    from jaxserve.loading.quantize_orbax import split_for_saving

    arrays, quantized = split_for_saving(_flat(params))  # quantized params: their arrays, described in MARKER
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "params"), arrays)
    checkpointer.wait_until_finished()
    if writes_description:
        with open(os.path.join(directory, MARKER), "w") as f:
            json.dump({"format": 1, "dtype": dtype, **({"quantized": quantized} if quantized else {})}, f)


RESTORE_GROUP_BYTES = 16 * 2**20  # params restored per orbax call: bounds the host buffers held at once


def restore_params(abstract_state: nnx.State, directory: str, dtype, placement) -> nnx.State:
    """Restore into the abstract state's shapes, each param placed where placement(path) says. Params
    come in groups of about RESTORE_GROUP_BYTES (orbax's partial restore), so that loading holds the
    weights once plus one group, not a second copy of the whole checkpoint in read buffers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxserve.loading.quantize import EMBEDDING, place, quantize, stored_shape
    from jaxserve.loading.quantize_orbax import assemble, restore_targets

    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = list(nnx.to_flat_state(abstract_state))
    compute_dtype = jnp.dtype(dtype).name  # the restoring engine's, which may not be the saving one's
    with open(os.path.join(directory, MARKER)) as f:
        saved = json.load(f).get("quantized", {})  # saved quantized: restored so, whatever the options say
    quantized = {name: {**description, "compute_dtype": compute_dtype} for name, description in saved.items()}
    target, to_quantize = {}, {}  # to_quantize: float params the engine's quantization option marked
    for path, variable in flat:
        name = ".".join(map(str, path))
        if name in quantized:
            transposed = tuple(map(str, path[-2:])) == EMBEDDING
            target.update(restore_targets(name, quantized[name], placement(path), transposed))
            continue
        spec = variable.get_metadata("quantization", None)  # quantize.mark_quantized: quantized as restored
        if spec is not None and spec.format != "auto":
            to_quantize[name] = (path, spec)
        sharding = default if name in to_quantize else placement(path) or default
        target[name] = jax.ShapeDtypeStruct(variable.get_value().shape, dtype, sharding=sharding)

    def quantized_now(name: str, value):  # a float param of a group, quantized as a fresh load would be
        path, spec = to_quantize[name]
        names = tuple(map(str, path))
        transposed = stored_shape(names, tuple(value.shape)) != tuple(value.shape)
        matrix = np.asarray(jax.device_get(value), np.float32)
        return place(quantize(matrix.T if transposed else matrix, spec, compute_dtype), placement(path), transposed)

    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    params_dir = os.path.join(os.path.abspath(directory), "params")
    restored = {}
    try:
        for group in _groups_of_bytes(target, RESTORE_GROUP_BYTES):
            restore_args = ocp.checkpoint_utils.construct_restore_args(group)
            group_restored = checkpointer.restore(
                params_dir, args=ocp.args.PyTreeRestore(item=group, restore_args=restore_args, partial_restore=True)
            )
            for name in group_restored.keys() & to_quantize.keys():  # within the group: one float copy at a time
                group_restored[name] = quantized_now(name, group_restored[name])
            restored.update(group_restored)
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise ValueError(f"cannot restore the orbax checkpoint in {directory}: {error}") from None
    missing = sorted(set(target) - set(restored))
    if missing:
        raise ValueError(f"the orbax checkpoint in {directory} lacks params {missing[:5]}")
    for name, description in quantized.items():
        restored[name] = assemble(name, description, restored)
    return nnx.from_flat_state(
        [(path, variable.replace(restored[".".join(map(str, path))])) for path, variable in flat]
    )


def _groups_of_bytes(target: dict, limit: int) -> list[dict]:
    groups, group, size = [], {}, 0
    for name, struct in target.items():
        nbytes = int(np.prod(struct.shape)) * np.dtype(struct.dtype).itemsize
        if group and size + nbytes > limit:
            groups.append(group)
            group, size = {}, 0
        group[name] = struct
        size += nbytes
    return groups + [group] if group else groups
