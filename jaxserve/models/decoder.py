"""The decoder-only causal LM every supported family shares (Llama, Mistral, Qwen2/3 and their MoE kin,
Gemma 2/3, Phi-3). An MoE model's layers listed in dense_layers keep a dense MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pages import AttentionMetadata, KVPages
from jaxserve.models.layers import MLP, Attention, Matmul, RMSNorm, WriteAndAttend, linear, project
from jaxserve.models.mla import LatentAttention
from jaxserve.models.moe import Experts, SparseMoE

# Legend: T = tokens in the step, E = embed, V = vocab, S = sequences sampled this step.


def embedding_rows(embed: nnx.Embed, token_ids):
    """embed(token_ids), bit for bit, its table and the ids first through an optimization barrier. XLA:CPU gathers
    a bfloat16 table through a float32 copy of it, which it fuses into the gather in a step; in a decode chain's
    loop (device/step.py chained_steps) it would hoist that conversion as loop-invariant and write the whole
    table out once a chain (113 MB for SmolLM2's: the chain ran at half the speed of single steps). The barrier
    ties the table to the loop's ids, so the conversion stays fused into the gather."""
    table = embed.embedding[...]
    if table.dtype != embed.dtype:
        return embed(token_ids)
    table, token_ids = jax.lax.optimization_barrier((table, token_ids))
    return jnp.take(table, token_ids, axis=0)


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype,
        write_and_attend: WriteAndAttend,
        matmul: Matmul,
        experts: Experts | None,
        rngs: nnx.Rngs,
    ):
        e, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_unit_offset
        self.input_layernorm = RMSNorm(e, eps, dtype, unit_offset=offset)
        attention = LatentAttention if config.is_latent_attention else Attention  # DeepSeek's MLA
        self.self_attn = attention(config, layer, dtype, write_and_attend, matmul, rngs)
        # Gemma's sandwich: post_attention_layernorm normalizes the attention's output, and two more norms
        # wrap the MLP; elsewhere post_attention_layernorm is the MLP's input norm
        self.post_attention_layernorm = RMSNorm(e, eps, dtype, unit_offset=offset)
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(e, eps, dtype, unit_offset=offset) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(e, eps, dtype, unit_offset=offset) if sandwich else None
        if not config.layer_is_moe(layer):
            self.mlp = MLP(config, dtype, matmul, rngs)
        elif experts is None:
            raise ValueError(f"a {config.model_type} layer with experts needs an experts function (sharding/moe.py)")
        else:
            self.mlp = SparseMoE(config, dtype, matmul, rngs, experts)

    def __call__(self, x, key_pages, value_pages, metadata: AttentionMetadata):
        # Attention and MLP take their input norm along: where the matmul plan's kernel runs it inside the q/k/v
        # and gate/up calls, a decode step skips its XLA thunks (issue #29)
        if isinstance(self.self_attn, Attention):
            attended, key_pages, value_pages = self.self_attn(x, key_pages, value_pages, metadata, self.input_layernorm)
        else:
            attended, key_pages, value_pages = self.self_attn(self.input_layernorm(x), key_pages, value_pages, metadata)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            x = x + self.post_attention_layernorm(attended)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x, key_pages, value_pages
        x = x + attended
        if isinstance(self.mlp, MLP):
            return x + self.mlp(x, self.post_attention_layernorm), key_pages, value_pages
        return x + self.mlp(self.post_attention_layernorm(x)), key_pages, value_pages


class CausalLM(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype,
        write_and_attend: WriteAndAttend,
        matmul: Matmul,
        experts: Experts | None,
        rngs: nnx.Rngs,
    ):
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
            embedding_metadata={"logical_axes": ("vocab", "embed")},
        )
        self.layers = nnx.List(
            [
                DecoderLayer(config, layer, dtype, write_and_attend, matmul, experts, rngs)
                for layer in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, unit_offset=config.norm_unit_offset)
        head_axes = ("embed", "vocab")
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else linear(
                config.hidden_size, config.vocab_size, head_axes, bias=False, dtype=dtype, matmul=matmul, rngs=rngs
            )
        )
        self.matmul = matmul
        # Gemma: embeddings scaled by sqrt(hidden), rounded to the params' dtype as transformers does
        self.embedding_scale = config.hidden_size**0.5 if config.scale_embeddings else None
        self.final_logit_soft_cap = config.final_logit_soft_cap

    def __call__(self, token_ids, kv_pages: KVPages, metadata: AttentionMetadata):
        """token_ids [T] -> final hidden states [T, E] and the updated pages."""
        # quantized, the embedding is stored as the head it also is, [E, V], and looks itself up
        quantized_lookup = getattr(self.embed_tokens.embedding[...], "embedding_rows", None)
        x = embedding_rows(self.embed_tokens, token_ids) if quantized_lookup is None else quantized_lookup(token_ids)
        if self.embedding_scale is not None:
            x = x * jnp.asarray(self.embedding_scale, x.dtype)
        keys, values = [], []
        for layer, key_pages, value_pages in zip(self.layers, kv_pages.keys, kv_pages.values):
            x, key_pages, value_pages = layer(x, key_pages, value_pages, metadata)
            keys.append(key_pages)
            values.append(value_pages)
        return self.norm(x), KVPages(keys=keys, values=values)

    def compute_logits(self, hidden):
        """hidden [S, E] -> float32 logits [S, V]."""
        if self.lm_head is None:  # tied: the embedding [V, E] is the head, contracted on E as it lies
            embedding = self.embed_tokens.embedding[...]
            transposed = not hasattr(embedding, "embedding_rows")  # a quantized one is stored [E, V]
            logits = project(hidden, embedding, matmul=self.matmul, transposed=transposed).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        if self.final_logit_soft_cap:  # Gemma 2
            logits = self.final_logit_soft_cap * jnp.tanh(logits / self.final_logit_soft_cap)
        return logits
