"""The tokenizer a GGUF file embeds, rebuilt as a Hugging Face `tokenizers` tokenizer.

llama.cpp stores the vocabulary (tokens, their types, scores or merges), the special token ids, the
BOS/EOS rule and the chat template as metadata. Two kinds are rebuilt, as transformers' GGUF loader
builds them:
- "llama" (sentencepiece): BPE with byte fallback, merges recovered from the scores, a metaspace
  prefix on the first word;
- "gpt2" (byte-level BPE), split by the regex llama.cpp's `tokenizer.ggml.pre` names (where transformers
  knows no split for a name, e.g. "smollm", llama.cpp's is used: its digits split one by one).
Tokens typed CONTROL (and UNKNOWN: "<unk>" in text is that token, as in transformers and llama.cpp) become
special added tokens, USER_DEFINED ones plain added tokens.
"""

from __future__ import annotations

from typing import cast

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from jaxserve.loading.fast_tokenizer import FastTokenizer
from jaxserve.loading.gguf import GGUFFile
from jaxserve.loading.tokenizer_config import TokenizerSettings

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# o200k (GPT-OSS: llama.cpp's "gpt-4o"), as its tokenizer.json writes it: cased words keep their contraction
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3 / R1 (llama.cpp's "deepseek-v3"): three splits in turn, as its tokenizer.json's Sequence
DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek LLM / V2 / V2-Lite (llama.cpp's "deepseek-llm"): six splits in turn, as its tokenizer.json's Sequence
# (the letter class is theirs: Latin, Greek, Cyrillic, Armenian, Georgian ... letters, without CJK)
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
SPLITS: dict[str, str | tuple[str, ...]] = {  # one regex, or several applied in turn
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "megrez": QWEN2_SPLIT,
    "gpt-4o": GPT4O_SPLIT,
    "deepseek-v3": DEEPSEEK3_SPLITS,
    "deepseek-llm": DEEPSEEK_LLM_SPLITS,
}
SINGLE_DIGIT_PRES = ("smollm", "starcoder", "refact")  # GPT-2's regex after splitting off each digit


def gguf_tokenizer(gguf: GGUFFile) -> FastTokenizer | None:
    """None when the file embeds no tokenizer (token-id prompts only)."""
    metadata = gguf.metadata
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    add_prefix_space = metadata.get("tokenizer.ggml.add_space_prefix", True)
    if kind == "gpt2":
        alphabet = set(_bytes_to_unicode().values())
        backend = _byte_level(tokens, metadata.get("tokenizer.ggml.merges") or [], metadata.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        alphabet = None
        backend = _sentencepiece(
            tokens, list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)), add_prefix_space
        )
    else:
        raise ValueError(f"GGUF file {gguf.path}: tokenizer model {kind!r} is not supported (llama, gpt2)")
    # A byte-level vocabulary spells every real token in its byte alphabet; a CONTROL token outside it is a
    # llama.cpp mislabel, and adding it would grow the vocabulary past the model's (transformers skips them too).
    backend.add_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind_ in zip(tokens, types)
            if kind_ in (CONTROL, UNKNOWN) and (alphabet is None or set(t) <= alphabet)
        ]
    )
    vocab = backend.get_vocab()
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind_ in zip(tokens, types)
            if kind_ == USER_DEFINED and t in vocab
        ]
    )
    return FastTokenizer(backend, _settings(gguf, tokens, kind))


def _settings(gguf: GGUFFile, tokens: list[str], kind: str) -> TokenizerSettings:
    metadata = gguf.metadata

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    special = {
        name: token(key)
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    # llama.cpp ends generation on any end-of-generation token: end of text, of turn, of message.
    stop_ids = tuple(
        metadata[f"tokenizer.ggml.{key}"]
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if metadata.get(f"tokenizer.ggml.{key}") is not None
    )
    # tokenizer.chat_template (the default) and tokenizer.chat_template.NAME; the converter's list of the names,
    # tokenizer.chat_templates, is not a template
    templates = {
        key.removeprefix("tokenizer.chat_template").lstrip(".") or "default": value
        for key, value in metadata.items()
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template.")
    }
    chat_template = templates.get("default") if list(templates) in ([], ["default"]) else templates
    return TokenizerSettings(
        source=gguf.path,
        # Sentencepiece vocabularies get BOS unless the file says otherwise, as llama.cpp and transformers do.
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        special_tokens={name: text for name, text in special.items() if text is not None},
        eos_tokens=(special["eos_token"],) if special["eos_token"] is not None else (),
        config_eos_token_ids=stop_ids,
        chat_template=chat_template or None,
        chat_template_source=gguf.path if templates else None,
    )


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            # pairs in a well-formed file; the tokenizers library refuses a merge of any other length
            merges=cast("list[tuple[str, str]]", [tuple(m.split(" ")) for m in merges]),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    if pre in SPLITS:
        regexes = SPLITS[pre]
        splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in _as_tuple(regexes)]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre in SINGLE_DIGIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _as_tuple(regexes: str | tuple[str, ...]) -> tuple[str, ...]:
    return (regexes,) if isinstance(regexes, str) else regexes


def _sentencepiece(tokens: list[str], scores: list[float], add_prefix_space: bool) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_from_scores(vocab, dict(zip(tokens, scores))),
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    # As sentencepiece's add_dummy_prefix (and llama.cpp, and transformers' legacy Llama conversion): every piece of
    # text between special tokens gets a "▁" first, even one that starts with a space. Metaspace's prepend_scheme
    # "first" skipped it there (" " became "▁", not "▁▁") and after special tokens ("<s>hello").
    spaces = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if add_prefix_space else spaces
    chain = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(chain + [decoders.Strip(" ", 1, 0)] if add_prefix_space else chain)
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a sentencepiece vocabulary implies: every split of a token into two tokens, the
    better-scored merged token first (transformers' generate_merges, so both tokenize alike)."""
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest for characters from 256 up."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return characters
