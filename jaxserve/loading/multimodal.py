"""The language model inside a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration): its tensors are
named as a text-only checkpoint's would be, and the rest (vision tower, projector) is left unread.

transformers >= 5 keeps the text model under model.language_model.* (lm_head at the top); checkpoints saved by
4.x (the released gemma-3-*-it ones, and 5.x's save_pretrained, which writes the old names) under
language_model.model.* and language_model.lm_head.*.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

LANGUAGE_MODEL_PREFIXES = {  # multimodal checkpoint prefix -> the text-only checkpoint's
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


def language_model_aliases(names: Iterable[str], where: str) -> dict[str, str]:
    """Text-only tensor name -> the checkpoint's own, for the language model of a multimodal checkpoint; {} for a
    text-only one. Logs (INFO) how many tensors of the other towers are not loaded."""
    names = list(names)
    aliases = {}
    for name in names:
        for prefix, text_prefix in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                aliases[text_prefix + name[len(prefix) :]] = name
    if aliases:
        ignored = [name for name in names if name not in aliases.values() and name != "lm_head.weight"]
        towers = sorted(
            {name.split(".")[0] if not name.startswith("model.") else name.split(".")[1] for name in ignored}
        )
        logger.info(
            "%s is a multimodal checkpoint: serving its language model; %d tensors of %s are not loaded "
            "(text input only)",
            where,
            len(ignored),
            ", ".join(towers) or "no other tower",
        )
    return aliases
