"""system_fingerprint: one short string that changes whenever what answers requests does (the
checkpoint, dtype, mesh, attention kernel or compiled buckets), so that a client can tell two
answers apart that came from different serving configurations (OpenAI's meaning of the field)."""

from __future__ import annotations

import hashlib
import os

import jaxserve
from jaxserve.engine.stats import EngineDescription


def checkpoint_identity(path: str) -> str:
    """The checkpoint's files by name and size: cheap (nothing is read), and a replaced checkpoint
    of the same name almost always differs in them."""
    if os.path.isfile(path):
        return f"{os.path.basename(path)}:{os.path.getsize(path)}"
    entries = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        entries.append(f"{name}:{os.path.getsize(full) if os.path.isfile(full) else 'dir'}")
    return ",".join(entries)


def system_fingerprint(description: EngineDescription, checkpoint_path: str) -> str:
    parts = (description.model_name, checkpoint_identity(checkpoint_path), description.dtype, description.mesh,
             description.attention_impl, repr(sorted(description.compiled_buckets)), jaxserve.__version__)
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
