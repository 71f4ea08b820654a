"""vLLM's LoRARequest, for offline code written against `vllm.LLM`: `llm.generate(prompts, params,
lora_request=LoRARequest("sql", 1, "/path/to/adapter"))` loads the adapter into a free slot on first use and
names it in the request. Adapters loaded this way give up their slot, least recently used first, when a call
needs one and none is free; adapters loaded by name (LLM.load_lora, the lora group's `adapters`) stay."""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int = 0  # vLLM's slot id; jaxserve picks slots itself
    lora_path: str = ""


class LoRARequests:
    """The adapters an LLM loaded for LoRARequests, in the order they were last used."""

    def __init__(self, engine):
        self.engine = engine
        self.loaded: OrderedDict[str, str] = OrderedDict()  # name -> path, least recently used first

    def names(self, lora_request, count: int) -> list[str | None]:
        """One adapter name (None: the base model) per prompt for `lora_request` (one request for all, or one per
        prompt), each loaded. Any object with vLLM's lora_name and lora_path works (vllm's own LoRARequest)."""
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"got {len(requests)} lora requests for {count} prompts")
        wanted = {}
        for request in requests:
            if request is None:
                continue
            name, path = getattr(request, "lora_name", None), getattr(request, "lora_path", None)
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ValueError(f"a lora request needs a lora_name and a lora_path, got {request!r}")
            if wanted.setdefault(name, path) != path:
                raise ValueError(f"LoRA adapter {name!r} asked for from two paths: {wanted[name]!r} and {path!r}")
        registry = self.engine.parts.lora
        if registry is not None and len(wanted) > registry.num_slots - 1:
            raise ValueError(
                f"these prompts ask for {len(wanted)} LoRA adapters at once, more than the engine's "
                f"{registry.num_slots - 1} slots (max_loras, or lora max_adapters)"
            )
        for name, path in wanted.items():
            self._ensure_loaded(name, path, keep=set(wanted))
        return [None if request is None else request.lora_name for request in requests]

    def _ensure_loaded(self, name: str, path: str, keep: set[str]) -> None:
        registry = self.engine.parts.lora
        loaded = registry.adapters.get(name) if registry is not None else None
        if loaded is not None:
            if os.path.realpath(loaded.path) != os.path.realpath(path):
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded from {loaded.path!r}, not {path!r}")
            if name in self.loaded:
                self.loaded.move_to_end(name)
            return
        for gone in [old for old in self.loaded if registry is None or old not in registry.adapters]:
            del self.loaded[gone]  # unloaded by hand (LLM.unload_lora) since
        if registry is not None and len(registry.adapters) >= registry.num_slots - 1:
            spare = next((old for old in self.loaded if old not in keep), None)
            if spare is not None:
                self.engine.unload_lora(spare)
                del self.loaded[spare]
        if registry is None:
            raise ValueError(
                "this engine has no LoRA slots: start it with enable_lora=True (and max_loras) or lora max_adapters"
            )
        self.engine.load_lora(name, path)
        self.loaded[name] = path
