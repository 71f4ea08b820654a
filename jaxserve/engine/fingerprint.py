"""A model's fingerprint: equal on two replicas means they serve the same model, so a router may send a
prefix to either and find the same pages (keys are over token ids, so the tokenizer matters too).

It is computed from what the model was opened from, without reading the weights: the architecture,
the tokenizer's ids for a probe text, and each checkpoint file's name, size and first and last bytes.
Two checkpoints that differ only in the middle of a weight file would collide; a fine-tune changes
every tensor, and so the sampled ends. Plain Python: the router computes it without JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.loading.model_source import ModelSource

SAMPLE_BYTES = 1 << 16  # read from each end of each checkpoint file
MAX_FILES = 4096
PROBE_TEXT = "The router checks that every replica tokenizes this sentence alike: 0123456789 ÅΩ 你好 🙂\n"


def _file_digests(path: str, digest) -> None:
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(root, name)
            for root, dirs, names in os.walk(path)
            for name in names
            if not name.startswith(".")
        )
    )
    for file in files[:MAX_FILES]:
        size = os.path.getsize(file)
        digest.update(f"{os.path.relpath(file, path) if file != path else ''}:{size}\n".encode())
        with open(file, "rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                digest.update(f.read(SAMPLE_BYTES))


def model_fingerprint(source: ModelSource) -> str:
    digest = hashlib.blake2b(digest_size=16)
    config = dict(dataclasses.asdict(source.config) if dataclasses.is_dataclass(source.config) else vars(source.config))
    # The engine's max_model_len is no property of the model, except where it picks LongRoPE's long factors:
    # then it changes every page's keys, and only which factors it picked counts.
    context_length = config.pop("context_length", None)
    scaling = getattr(source.config, "rope_scaling", None)
    if scaling is not None and scaling.rope_type == "longrope" and context_length is not None:
        config["longrope_long_factors"] = context_length > scaling.original_max_position_embeddings
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    if source.tokenizer is not None:
        digest.update(json.dumps(source.tokenizer.encode(PROBE_TEXT)).encode())
    _file_digests(source.path, digest)
    return digest.hexdigest()
