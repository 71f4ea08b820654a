"""Mixture-of-experts load: tokens routed to each expert, and moving experts so devices carry even loads.

One object owns it all: the engine hands it each step's routing counts (`observe`), asks it once a
step whether to move experts (`maybe_rebalance`), and reports what it knows (`stats`). Under expert
parallelism, the placement is an input of the compiled step, so moving experts recompiles nothing.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.config import ModelConfig
from sharding.expert_placement import device_of_experts, read_load_profile, rebalance


class ExpertBalancer:
    def __init__(self, model: ModelConfig, runner, num_devices: int | None, rebalance_interval: int = 0):
        """num_devices: the expert-parallel devices (None: experts are not spread over devices)."""
        # rows: the layers with experts (Qwen2-MoE may keep dense MLPs in some)
        self.num_layers, self.num_experts = model.num_moe_layers, model.num_experts
        self.runner = runner
        self.num_devices = num_devices
        self.rebalance_interval = rebalance_interval
        self.expert_tokens = np.zeros((self.num_layers, model.num_experts), np.int64)  # cumulative, real tokens
        self._tokens_at_last_move = self.expert_tokens.copy()  # the periodic rebalance's window starts here
        self.num_rebalances = 0
        # [layers, experts]: the device each expert sits on (expert parallelism only)
        self.expert_devices = device_of_experts(runner.params()) if num_devices else None

    def observe(self, expert_counts) -> None:
        """A step's [layers, experts] routed-token counts."""
        self.expert_tokens += np.asarray(expert_counts)

    def maybe_rebalance(self, num_steps: int) -> None:
        """Every rebalance_interval steps, move experts by the load routed since the last move."""
        if not self.rebalance_interval or num_steps % self.rebalance_interval:
            return
        window = self.expert_tokens - self._tokens_at_last_move
        if window.any():
            self.rebalance(window)
            self._tokens_at_last_move = self.expert_tokens.copy()

    def rebalance(self, load=None) -> None:
        """Move experts so that, under `load` (tokens per expert: [layers, experts], [experts], or a JSON
        file; default: everything routed so far), each layer's devices carry even loads."""
        self.apply(self.checked_load(load))

    def checked_load(self, load) -> np.ndarray:
        """rebalance's load as a [layers, experts] array, or a ValueError naming what is wrong."""
        if not self.num_devices:
            raise ValueError(
                "rebalance_experts needs a mixture-of-experts model with enable_expert_parallel "
                "over more than one device"
            )
        load = read_load_profile(self.expert_tokens if load is None else load, self.num_layers, self.num_experts)
        if not load.any():
            raise ValueError("the expert load profile is all zeros: nothing to balance by")
        return load

    def apply(self, load: np.ndarray) -> None:
        self.runner.replace_params(rebalance(self.runner.params(), load))
        self.expert_devices = device_of_experts(self.runner.params())
        self.num_rebalances += 1

    def stats(self) -> dict:
        """Tokens routed to each expert so far (per layer), and how uneven that is (max / mean)."""
        per_expert = self.expert_tokens.sum(axis=0)
        mean = per_expert.mean()
        stats = {
            "expert_tokens": self.expert_tokens.tolist(),
            "expert_load_max_over_mean": round(float(per_expert.max() / mean), 4) if mean else 0.0,
        }
        if self.num_devices:
            assert self.expert_devices is not None  # set whenever num_devices is
            per_layer = np.stack(
                [
                    np.bincount(devices, weights=tokens, minlength=self.num_devices)
                    for devices, tokens in zip(self.expert_devices, self.expert_tokens)
                ]
            )  # [L, D]
            # Every layer waits for its busiest device: the imbalance that costs time is per layer,
            # sum over layers of (busiest device) / sum over layers of (mean device).
            imbalance = per_layer.max(axis=1).sum() / per_layer.mean(axis=1).sum() if mean else 0.0
            stats.update(
                expert_device_tokens=per_layer.sum(axis=0).astype(np.int64).tolist(),
                expert_devices=self.expert_devices.tolist(),
                expert_rebalances=self.num_rebalances,
                expert_device_imbalance=round(float(imbalance), 4),
            )
        return stats
