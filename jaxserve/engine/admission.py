"""What a request must pass before it is queued: a prompt the model can read, limits the engine can hold,
and sampling controls it can honour. Every check raises ValueError naming the problem; the server calls
these on its handler threads (a grammar compiles there, not on the engine loop)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config import EngineRole
from jaxserve.engine.builder import EngineParts
from jaxserve.engine.constraints import RowConstraints
from jaxserve.host.page_allocator import num_pages_for
from jaxserve.host.request import SamplingParams, truncate_prompt


def prompt_input(prompt):
    """A prompt as a string or token ids, from vLLM's dict forms too ({"prompt": text} / {"prompt_token_ids":
    ids}); a dict with anything else (multi_modal_data, ...) is refused rather than partly honoured."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and not isinstance(prompt["prompt_token_ids"], str):
        return prompt["prompt_token_ids"]  # tokenize checks they are token ids
    raise ValueError(
        'a prompt dict takes exactly one of "prompt" (text) or "prompt_token_ids" (token ids), got '
        f"{ {str(key): type(value).__name__ for key, value in prompt.items()} }"
    )


class RequestChecks:
    def __init__(self, parts: EngineParts, constraints: RowConstraints):
        self.parts = parts
        self.tokenizer = parts.source.tokenizer
        self.vocab_size = parts.source.config.vocab_size
        self.constraints = constraints

    def tokenize(self, prompt: str | list[int] | dict) -> list[int]:
        prompt = prompt_input(prompt)
        if isinstance(prompt, str):
            # "" is tokenized, as vLLM does: [BOS] where the tokenizer adds one; no tokens at all is refused
            # by validate
            if self.tokenizer is None:
                raise ValueError(f"model {self.parts.source.name!r} has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        bad = [int(t) for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return [int(t) for t in prompt]

    def truncated(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request uses it: its last truncate_prompt_tokens tokens (vLLM's left truncation)."""
        return truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.parts.max_model_len)

    def room(self, prompt_token_ids: list[int]) -> int:
        """Tokens a sequence may generate after this prompt: what max_model_len and the KV cache leave."""
        page_size = self.parts.config.cache.page_size
        most = min(self.parts.max_model_len, self.parts.schedulers[0].allocator.num_usable_pages * page_size)
        return max(most - len(prompt_token_ids), 0)

    def with_max_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """params with max_tokens None (vLLM's "until the context ends") made the room the prompt leaves."""
        if params.max_tokens is not None:
            return params
        room = self.room(prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"the prompt ({len(prompt_token_ids)} tokens) leaves no room to generate within max_model_len "
                f"({self.parts.max_model_len}) and the KV cache"
            )
        if params.min_tokens > room:
            raise ValueError(f"min_tokens ({params.min_tokens}) is more than the {room} tokens the prompt leaves")
        return dataclasses.replace(params, max_tokens=room)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        config, max_model_len = self.parts.config, self.parts.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (it has no tokens)")
        params = self.with_max_tokens(prompt_token_ids, params)
        total = len(prompt_token_ids) + params.max_new_tokens
        if total > max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{total}, more than max_model_len ({max_model_len})"
            )
        max_pages = self.parts.schedulers[0].allocator.num_usable_pages
        if num_pages_for(total, config.cache.page_size) > max_pages:
            raise ValueError(
                f"a sequence of {total} tokens needs more KV pages than the cache has "
                f"({max_pages}); raise num_pages or kv_cache_memory_gib"
            )
        after = params.guided_decoding_after_token
        if after is not None and after >= self.vocab_size:
            raise ValueError(f"guided_decoding_after_token {after} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise ValueError(
                f"stop_token_ids {max(params.stop_token_ids)} is outside the vocabulary [0, {self.vocab_size})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > config.scheduler.max_logprobs:
                raise ValueError(f"{name} ({value}) exceeds max_logprobs ({config.scheduler.max_logprobs})")
        if params.prompt_logprobs is not None and config.disagg.role == EngineRole.PREFILL:
            # its prompt logprobs would stay here while the request goes on on a decode replica
            raise ValueError("prompt_logprobs is not supported on a prefill replica (engine.role prefill)")
        self.constraints.validate(params)
