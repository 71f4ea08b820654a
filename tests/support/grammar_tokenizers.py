"""The real tokenizers the grammar tests decode with (byte-level Qwen-style, metaspace Llama-style, a lone
sentencepiece tokenizer.model), and a GrammarCompiler for each over a padded vocabulary."""

import functools
import os
import shutil
import tempfile

from jaxserve.host.grammar import GrammarCompiler
from jaxserve.loading.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZERS = ["qwen_byte_level", "llama_metaspace", "sentencepiece"]
# The model's embedding has more rows than the tokenizer has tokens (a padded vocabulary): never allowed.
# 45 is no multiple of 32, so the padding ends mid-word.
NUM_PADDED_ROWS = 45


@functools.cache
def load_tokenizer(name: str) -> Tokenizer:
    if name == "sentencepiece":
        directory = tempfile.mkdtemp()
        try:
            shutil.copy(os.path.join(ROOT, "tests", "fixtures", "tokenizer.model"), directory)
            tokenizer = Tokenizer.from_model_dir(directory)
        finally:
            shutil.rmtree(directory)
    else:
        tokenizer = Tokenizer.from_model_dir(os.path.join(ROOT, "tests", "loading", "fixtures", name))
    assert tokenizer is not None
    return tokenizer


@functools.cache
def compiler_for(name: str) -> GrammarCompiler:
    tokenizer = load_tokenizer(name)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + NUM_PADDED_ROWS, tokenizer.eos_token_ids)
