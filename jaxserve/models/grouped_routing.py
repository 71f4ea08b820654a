"""DeepSeek's expert routing, as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter compute it.

Scores are a softmax (V2) or a sigmoid (V3) of the router logits in float32. With groups, the experts
split into num_groups equal groups, each group is ranked by its best score (V2's group_limited_greedy)
or the sum of its two best (V3's noaux_tc, scores shifted by the correction bias), and only the experts
of the best num_groups_kept groups compete for the top k. V3's bias only chooses: the weights are the
unbiased scores, renormalized where the model says so, then multiplied by routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.models.layers import row_softmax, tree_sum

# Legend: T = tokens, X = experts, G = groups, k = experts per token.


@dataclass(frozen=True)
class GroupedRouting:
    top_k: int
    scoring: str  # softmax | sigmoid
    group_scoring: str  # none | max | top2_sum
    num_groups: int
    num_groups_kept: int
    normalize: bool
    scaling_factor: float

    @classmethod
    def from_config(cls, config: ModelConfig) -> GroupedRouting:
        return cls(
            top_k=config.num_experts_per_token,
            scoring=config.expert_scoring,
            group_scoring=config.expert_group_scoring,
            num_groups=config.num_expert_groups,
            num_groups_kept=config.num_expert_groups_kept,
            normalize=config.normalize_expert_weights,
            scaling_factor=config.routed_scaling_factor,
        )

    def __call__(self, router_logits, correction_bias=None):
        """router_logits [T, X], correction_bias [X] or None -> (weights [T, k] float32, expert ids [T, k])."""
        logits = router_logits.astype(jnp.float32)
        scores = jax.nn.sigmoid(logits) if self.scoring == "sigmoid" else row_softmax(logits)
        choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)[None, :]
        if self.group_scoring != "none" and self.num_groups_kept < self.num_groups:
            choice = self._keep_best_groups(choice)
        _, expert_ids = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
        if self.normalize:
            weights = weights / (tree_sum(weights) + 1e-20)
        return weights * self.scaling_factor, expert_ids

    def _keep_best_groups(self, choice):
        """choice [T, X] with the experts outside the best num_groups_kept groups at -inf."""
        num_tokens, num_experts = choice.shape
        grouped = choice.reshape(num_tokens, self.num_groups, num_experts // self.num_groups)  # [T, G, X/G]
        if self.group_scoring == "max":
            group_scores = grouped.max(axis=-1)
        else:
            group_scores = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(axis=-1)  # [T, G]
        _, kept = jax.lax.top_k(group_scores, self.num_groups_kept)  # [T, kept]
        kept_groups = jax.nn.one_hot(kept, self.num_groups, dtype=jnp.bool_).any(axis=1)  # [T, G]
        kept_experts = jnp.repeat(kept_groups, num_experts // self.num_groups, axis=1)  # [T, X]
        return jnp.where(kept_experts, choice, -jnp.inf)
