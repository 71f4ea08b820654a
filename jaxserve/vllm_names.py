"""vLLM's engine argument names, for code written against `vllm.LLM(...)`: each is mapped onto the jaxserve option
that does the same thing, or refused with a pointer to the option that does the job here. Nothing is silently
dropped except arguments that cannot change an output here (trust_remote_code: jaxserve never runs a
checkpoint's code; enforce_eager: steps are always compiled ahead of time)."""

from __future__ import annotations

RENAMED = {"block_size": "page_size", "max_loras": "max_adapters", "max_lora_rank": "max_rank"}
KV_CACHE_DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "fp8": "float8_e4m3",
    "fp8_e4m3": "float8_e4m3",
    "int8": "int8",
}
# speculative_config's keys -> the speculative group's, and its methods -> jaxserve's
SPECULATIVE_KEYS = {
    "method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "model": "draft_model",
    "quantization": "draft_quantization",
}
SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft"}
IGNORED = ("trust_remote_code", "enforce_eager")
POINTERS = {
    "gpu_memory_utilization": "the KV cache is sized by kv_cache_memory_gib or num_pages",
    "tokenizer": "the tokenizer is read from the model's directory or GGUF file",
    "enable_chunked_prefill": "prefills are always chunked (max_num_batched_tokens tokens a step)",
    "kv_cache_dtype": f"kv_dtype takes {sorted(KV_CACHE_DTYPES)}",
}


def from_vllm_names(options: dict, known: set[str]) -> dict:
    """options with vLLM's names (those jaxserve does not use itself) turned into jaxserve's; ValueError for a
    value jaxserve cannot honour, or a name given both ways."""
    options = dict(options)

    def put(name: str, value) -> None:
        if name in options:
            raise ValueError(f"engine option {name} given twice (once by its vLLM name)")
        options[name] = value

    for name in IGNORED:
        if name not in known:
            options.pop(name, None)
    for vllm_name, name in RENAMED.items():
        if vllm_name in options and vllm_name not in known:
            put(name, options.pop(vllm_name))
    if "kv_cache_dtype" in options and "kv_cache_dtype" not in known:
        value = options.pop("kv_cache_dtype")
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {value!r} is not supported; {POINTERS['kv_cache_dtype']}")
        put("kv_dtype", KV_CACHE_DTYPES[value])
    if "enable_lora" in options and "enable_lora" not in known:
        if options.pop("enable_lora") and "max_adapters" not in options:
            options["max_adapters"] = 1  # vLLM's max_loras default
    if "speculative_config" in options and "speculative_config" not in known:
        group = speculative_group(options.pop("speculative_config"))
        if group is not None:
            put("speculative", group)
    for name, pointer in POINTERS.items():
        if name in options and name not in known:
            raise ValueError(f"engine option {name} (vLLM's) has no counterpart here: {pointer}")
    return options


def speculative_group(config) -> dict | None:
    """vLLM's speculative_config dict as jaxserve's speculative group."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config keys {unknown} are not supported; known: {sorted(SPECULATIVE_KEYS)}")
    group = {SPECULATIVE_KEYS[key]: value for key, value in config.items()}
    method = group.get("method")
    if method is None and "draft_model" in group:
        method = "draft_model"  # vLLM infers a draft model from `model`
    if method is not None:
        group["method"] = SPECULATIVE_METHODS.get(method, method)  # an unknown one is refused by the group
    return group
