"""Models: pure functions of (params, tokens, positions, kv pages, attention metadata) -> (hidden, kv pages).

`build_model` returns a flax nnx module for the configured architecture; the runner splits it into a
static graph and a params pytree, so nothing is stored on modules between steps.
"""

from jaxserve.models.kv_pages import KVPages, AttentionMetadata
from jaxserve.models.decoder import CausalLM


def build_model(config, dtype, attention_impl: str = "reference", rngs=None, attention_mesh=None,
                expert_parallel_mesh=None):
    """attention_mesh: each device attends over its own sequences and kv heads (sharding/attention.py);
    expert_parallel_mesh: experts spread over it."""
    from flax import nnx

    return CausalLM(config, dtype=dtype, attention_impl=attention_impl, rngs=rngs or nnx.Rngs(0),
                    attention_mesh=attention_mesh, expert_parallel_mesh=expert_parallel_mesh)


__all__ = ["AttentionMetadata", "CausalLM", "KVPages", "build_model"]
