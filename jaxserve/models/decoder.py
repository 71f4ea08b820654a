"""The Llama-family causal LM (Llama, Mistral, and Mixtral when the config has experts)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.kv_pages import AttentionMetadata, KVPages
from jaxserve.models.layers import MLP, Attention, RMSNorm, linear
from jaxserve.models.moe import SparseMoE

# Legend: T = tokens in the step, E = embed, V = vocab, S = sequences sampled this step.


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, attention_impl: str, rngs: nnx.Rngs, attention_mesh=None,
                 expert_parallel_mesh=None):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, attention_impl, rngs, attention_mesh)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = SparseMoE(config, dtype, rngs, expert_parallel_mesh) if config.is_moe else MLP(config, dtype, rngs)

    def __call__(self, x, key_pages, value_pages, metadata: AttentionMetadata):
        attended, key_pages, value_pages = self.self_attn(self.input_layernorm(x), key_pages, value_pages, metadata)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), key_pages, value_pages


class CausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, attention_impl: str = "reference", rngs: nnx.Rngs,
                 attention_mesh=None, expert_parallel_mesh=None):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, attention_impl, rngs, attention_mesh,
                                             expert_parallel_mesh) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, token_ids, kv_pages: KVPages, metadata: AttentionMetadata):
        """token_ids [T] -> final hidden states [T, E] and the updated pages."""
        x = self.embed_tokens(token_ids)
        keys, values = [], []
        for layer, key_pages, value_pages in zip(self.layers, kv_pages.keys, kv_pages.values):
            x, key_pages, value_pages = layer(x, key_pages, value_pages, metadata)
            keys.append(key_pages)
            values.append(value_pages)
        return self.norm(x), KVPages(keys=keys, values=values)

    def compute_logits(self, hidden):
        """hidden [S, E] -> float32 logits [S, V]."""
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)
