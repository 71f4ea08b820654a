"""system_fingerprint: one short string that changes whenever what answers requests does (the model,
as engine/fingerprint.py identifies it from the checkpoint, config and tokenizer; the dtype, mesh,
attention kernel or compiled buckets; the server's version), so that a client can tell apart answers
that came from different serving configurations (OpenAI's meaning of the field)."""

from __future__ import annotations

import hashlib

import jaxserve
from jaxserve.engine.stats import EngineDescription


def system_fingerprint(description: EngineDescription) -> str:
    parts = (
        description.model_name,
        description.model_fingerprint,
        description.dtype,
        description.mesh,
        description.attention_impl,
        repr(sorted(description.compiled_buckets)),
        jaxserve.__version__,
    )
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
