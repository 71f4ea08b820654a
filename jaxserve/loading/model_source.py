"""Opening a model: whatever the path holds (a Hugging Face directory, a jaxserve orbax checkpoint, a
llama.cpp GGUF file or a directory holding one), the engine gets one `ModelSource`: the architecture,
the tokenizer, the checkpoint's dtype, and a function that fills an abstract param tree with placed
arrays."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.loading.default_model import MODEL_NAMES, resolve_model_path
from jaxserve.loading.gguf import GGUFFile, find_gguf_file
from jaxserve.loading.gguf_tokenizer import gguf_tokenizer
from jaxserve.loading.orbax_checkpoint import checkpoint_dtype, is_orbax_checkpoint
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.models.config import ModelConfig

# The readers (jaxserve.loading.weights, orbax_checkpoint.restore_params, the families' name tables) are
# imported by read_params, when weights are read: the router opens a model for its tokenizer and
# fingerprint only, and must not load JAX.


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
    """A Hugging Face model directory (config.json, *.safetensors, a tokenizer), an orbax checkpoint
    that LLM.save_checkpoint wrote, or a GGUF file; or a model name ("default", "tiny-random") where no
    such path exists. Raises ValueError naming the path when it is none of these."""
    if path in MODEL_NAMES and not os.path.exists(path):
        path = resolve_model_path(path)
    gguf_path = find_gguf_file(path)
    if gguf_path is not None:
        return open_gguf(gguf_path)
    if not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist")
    config = ModelConfig.from_model_dir(path)
    tokenizer = Tokenizer.from_model_dir(path)
    if is_orbax_checkpoint(path):

        def read_params(abstract, dtype, placement):
            from jaxserve.loading.orbax_checkpoint import restore_params

            return restore_params(abstract, path, dtype, placement)

        return ModelSource(path, config, tokenizer, checkpoint_dtype(path), read_params, path)

    def read_params(abstract, dtype, placement):
        from jaxserve.loading.weights import load_params

        return load_params(abstract, path, config, dtype, placement)

    return ModelSource(path, config, tokenizer, config.checkpoint_dtype, read_params, path)


def open_gguf(path: str) -> ModelSource:
    """Everything is read and checked here (metadata, tensor types, tokenizer); weights dequantize later,
    one tensor at a time, as read_params places them."""
    gguf = GGUFFile(path)
    hf_config = gguf.hf_config()
    try:
        config = ModelConfig.from_hf_dict(hf_config)
    except ValueError as error:
        raise ValueError(f"GGUF file {path}: {error}") from None
    tokenizer = gguf_tokenizer(gguf)

    def read_params(abstract, dtype, placement):
        from jaxserve.loading.weights import read_params as read_named_params
        from jaxserve.models import CHECKPOINT_NAMES

        try:
            return read_named_params(
                abstract, gguf.tensor_reader(), CHECKPOINT_NAMES[config.model_type], dtype, placement
            )
        except ValueError as error:  # a tensor of the wrong shape: its message names the tensor, this the file
            message = str(error)
            raise ValueError(message if path in message else f"GGUF file {path}: {message}") from None

    return ModelSource(
        path, config, tokenizer, gguf.checkpoint_dtype(), read_params, _gguf_description_dir(hf_config, tokenizer)
    )


def _gguf_description_dir(hf_config: dict, tokenizer) -> str:
    """The Hugging Face files a GGUF's metadata amounts to (config.json, tokenizer.json, tokenizer_config.json),
    written where save_checkpoint copies description files from, so a saved checkpoint opens on its own."""
    directory = tempfile.mkdtemp(prefix="jaxserve-gguf-")
    atexit.register(shutil.rmtree, directory, True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    if tokenizer is not None:
        tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(dict(tokenizer.special_tokens, chat_template=tokenizer.chat_template), f, indent=1)
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(dict(eos_token_id=sorted(tokenizer.eos_token_ids)), f, indent=1)
    return directory
