"""LoRA adapters on a draft model: a draft that is the target's own quantized copy (`draft_model: self`)
has the target's projections, so every adapter the target serves applies to it too. The draft gets adapter
slots of its own (the same target modules, slots and rank), and `AdaptersWithDraft` loads and unloads each
adapter into the target's and the draft's slots together, at the same slot number, so that a draft row
binds the slot its sequence uses (engine/draft_proposer.py) and proposes what the adapted target would.

A draft of another model (its own `draft_model`) has other projections: it proposes from its base weights
for every row (outputs stay the target's; adapter rows accept fewer proposals), which start-up logs once.
"""

from __future__ import annotations

import logging

from jaxserve.lora.registry import LoadedAdapter, LoraRegistry

logger = logging.getLogger(__name__)


class AdaptersWithDraft(LoraRegistry):
    """The target's adapter registry, which loads and unloads every adapter into the draft's slots too."""

    def __init__(self, config, runner, all_slots, draft: LoraRegistry):
        super().__init__(config, runner, all_slots)
        self.draft = draft

    def load(self, name: str, path: str) -> LoadedAdapter:
        loaded = super().load(name, path)  # checks and refusals: the target's
        try:
            mirrored = self.draft.load(name, path)
        except Exception:
            super().unload(name)
            raise
        if mirrored.slot != loaded.slot:  # both registries saw the same loads and unloads, in order
            raise AssertionError(
                f"adapter {name!r} took slot {loaded.slot} in the target, {mirrored.slot} in the draft"
            )
        return loaded

    def unload(self, name: str) -> None:
        super().unload(name)
        self.draft.unload(name)


def log_adapters_not_followed(draft_model: str) -> None:
    logger.warning(
        "speculative draft %r is another model than the target: it proposes from its base weights for rows "
        "with a LoRA adapter (outputs stay the target's; those rows accept fewer proposals)",
        draft_model,
    )
