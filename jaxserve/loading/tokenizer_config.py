"""What a model directory says about its tokenizer beyond the vocabulary, read the way transformers reads it.

tokenizer_config.json names the special tokens (bos/eos/unk/pad, extra ones, eos_token possibly as a
list), the added tokens with their matching flags, the BOS/EOS rule for sentencepiece models, the chat
template and clean-up; chat_template.jinja overrides the config's template; special_tokens_map.json
fills in for old checkpoints whose config has no added_tokens_decoder. config.json and
generation_config.json add the EOS ids generation stops on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tokenizers import AddedToken

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class TokenizerSettings:
    source: str = ""  # the directory or file named in errors
    add_bos_token: bool | None = None  # None: the tokenizer's own rule
    add_eos_token: bool | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # "bos_token" -> "<s>": what chat templates read
    eos_tokens: tuple[str, ...] = ()  # every eos_token text (a config may list several)
    extra_special_tokens: tuple[str, ...] = ()
    added_tokens: tuple[AddedToken, ...] = ()  # added_tokens_decoder, in id order
    added_token_ids: tuple[int, ...] = ()  # their ids (added_tokens_decoder's keys)
    config_eos_token_ids: tuple[int, ...] = ()  # config.json and generation_config.json together
    chat_template: str | dict[str, str] | None = None
    chat_template_source: str | None = None  # the file the template came from, for errors
    clean_up_tokenization_spaces: bool = False
    # transformers' LlamaTokenizer over a sentencepiece model (tokenizer_class), and its `legacy` flag (None: unset)
    llama_tokenizer_class: bool = False
    legacy: bool | None = None


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"malformed {path}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"malformed {path}: expected a JSON object")
    return value


def token_text(value, path: str) -> str | None:
    """A special token as configs spell it: a string, or an AddedToken dict with its content."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"malformed {path}: a special token must be a string or have a 'content', got {value!r}")


def _added_token(value, path: str) -> AddedToken:
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
    return AddedToken(token_text(value, path), **flags)


def _eos_ids(value) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _chat_template(model_dir: str, config: dict, config_path: str) -> tuple[str | dict | None, str | None]:
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), jinja_path
    template = config.get("chat_template")
    legacy_path = os.path.join(model_dir, "chat_template.json")
    if template is None and os.path.isfile(legacy_path):
        template, config_path = (_read_json(legacy_path) or {}).get("chat_template"), legacy_path
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        try:
            template = {entry["name"]: entry["template"] for entry in template}
        except (KeyError, TypeError):
            raise ValueError(f"malformed {config_path}: chat_template entries need a name and a template") from None
    if template is not None and not isinstance(template, (str, dict)):
        raise ValueError(f"malformed {config_path}: chat_template must be a string or a list of named templates")
    return template, config_path if template is not None else None


def read_tokenizer_settings(model_dir: str) -> TokenizerSettings:
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = _read_json(config_path) or {}
    if "added_tokens_decoder" not in config:
        # Old checkpoints keep their special tokens here; transformers reads it only in that case.
        config.update(_read_json(os.path.join(model_dir, "special_tokens_map.json")) or {})
    special_tokens, eos_tokens = {}, ()
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        texts = (
            [token_text(v, config_path) for v in value] if isinstance(value, list) else [token_text(value, config_path)]
        )
        texts = [t for t in texts if t is not None]
        if texts:
            special_tokens[name] = texts[0]
        if name == "eos_token":
            eos_tokens = tuple(texts)
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
    decoder = config.get("added_tokens_decoder") or {}
    try:
        keys = sorted(decoder, key=int)
        added_ids = tuple(int(key) for key in keys)
        added = tuple(_added_token(decoder[key], config_path) for key in keys)
    except (ValueError, TypeError) as error:
        raise ValueError(f"malformed {config_path}: added_tokens_decoder: {error}") from None
    model_config = _read_json(os.path.join(model_dir, "config.json")) or {}
    generation_config = _read_json(os.path.join(model_dir, "generation_config.json")) or {}
    chat_template, template_source = _chat_template(model_dir, config, config_path)
    return TokenizerSettings(
        source=model_dir,
        add_bos_token=config.get("add_bos_token") if isinstance(config.get("add_bos_token"), bool) else None,
        add_eos_token=config.get("add_eos_token") if isinstance(config.get("add_eos_token"), bool) else None,
        special_tokens=special_tokens,
        eos_tokens=eos_tokens,
        extra_special_tokens=tuple(t for t in (token_text(v, config_path) for v in extra) if t is not None)
        + eos_tokens[1:],
        added_tokens=added,
        added_token_ids=added_ids,
        config_eos_token_ids=_eos_ids(model_config.get("eos_token_id"))
        + _eos_ids(generation_config.get("eos_token_id")),
        chat_template=chat_template,
        chat_template_source=template_source,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        llama_tokenizer_class=config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast"),
        legacy=config.get("legacy") if isinstance(config.get("legacy"), bool) else None,
    )
