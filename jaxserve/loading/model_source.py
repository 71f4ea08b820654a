"""Opening a model: whatever the path holds (a Hugging Face directory, a jaxserve orbax checkpoint),
the engine gets one `ModelSource`: the architecture, the tokenizer, the checkpoint's dtype, and a
function that fills an abstract param tree with placed arrays."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from jaxserve.models.config import ModelConfig
from jaxserve.loading.orbax_checkpoint import checkpoint_dtype, is_orbax_checkpoint, restore_params
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import load_params


@dataclass(frozen=True)
class ModelSource:
    path: str
    config: ModelConfig
    tokenizer: Tokenizer | None
    checkpoint_dtype: str
    # (abstract params, dtype, placement(path) -> sharding | None) -> params, each placed as it is read
    read_params: Callable
    description_dir: str  # where config.json and the tokenizer files live (copied into saved checkpoints)

    @property
    def name(self) -> str:
        """What clients see as the model's name: the directory's name, never a host path."""
        return os.path.basename(os.path.normpath(self.path))


def open_model(path: str) -> ModelSource:
    """A Hugging Face model directory (config.json, *.safetensors, a tokenizer) or an orbax checkpoint
    that LLM.save_checkpoint wrote. Raises ValueError naming the path when it is neither."""
    if not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist")
    config = ModelConfig.from_model_dir(path)
    tokenizer = Tokenizer.from_model_dir(path)
    if is_orbax_checkpoint(path):
        def read_params(abstract, dtype, placement):
            return restore_params(abstract, path, dtype, placement)

        return ModelSource(path, config, tokenizer, checkpoint_dtype(path), read_params, path)

    def read_params(abstract, dtype, placement):
        return load_params(abstract, path, config, dtype, placement)

    return ModelSource(path, config, tokenizer, config.checkpoint_dtype, read_params, path)
