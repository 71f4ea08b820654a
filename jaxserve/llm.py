"""The offline API, shaped like vLLM's: LLM(model_dir, **engine_options).generate(prompts, params)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceOf

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.distributed.runtime import ProcessGroup
from jaxserve.engine import Engine
from jaxserve.engine.admission import prompt_input
from jaxserve.host.request import RequestOutput, SamplingParams
from jaxserve.loading.chat_template import (
    chat_template_argument,
    render_chat,
    template_messages,
    template_variables,
)
from jaxserve.lora.request import LoRARequests


class LLM:
    def __init__(
        self,
        model: str,
        *,
        process_group: ProcessGroup | None = None,
        lora_adapters: dict[str, str] | None = None,
        **engine_options,
    ):
        """process_group: jaxserve.distributed.runtime.initialize's, to build the engine over several processes.
        lora_adapters: {name: PEFT adapter directory} to load at start-up (the lora group's `adapters`)."""
        if lora_adapters is not None:
            engine_options["adapters"] = lora_adapters
        self.engine = Engine.from_model(model, EngineConfig.from_options(**engine_options), process_group)
        self._request_ids = itertools.count()
        self._lora_requests = LoRARequests(self.engine)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        session_ids: SequenceOf[str | None] | None = None,
        lora: str | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of token ids, or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}.

        session_ids (one per prompt) mark conversations likely to continue, whose cached pages are
        kept in preference to others for a while (the engine's session_ttl).

        lora: the name of a loaded LoRA adapter for every prompt whose SamplingParams name none.
        lora_request: vLLM's LoRARequest (jaxserve.LoRARequest, or vllm's own), one for every prompt or a list
        with one per prompt: the adapter is loaded on first use (jaxserve/lora/request.py).

        Every prompt is validated before any is queued, so a bad one raises ValueError and leaves the
        engine as it was.
        """
        one_id_list = isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        if isinstance(prompts, (str, dict)) or one_id_list:
            prompts = [prompts]
        prompts = [prompt_input(prompt) for prompt in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        if lora is not None and lora_request is not None:
            raise ValueError("give lora (an adapter's name) or lora_request, not both")
        names = [lora] * len(prompts) if lora_request is None else self._lora_requests.names(lora_request, len(prompts))
        sampling_params = [
            dataclasses.replace(params, lora=name)
            if name is not None and isinstance(params, SamplingParams) and params.lora is None
            else params
            for params, name in zip(sampling_params, names)
        ]
        for prompt, params in zip(prompts, sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
            self.engine.validate(self.engine.tokenize(prompt, params), params)

        session_ids = list(session_ids) if session_ids is not None else [None] * len(prompts)
        if len(session_ids) != len(prompts):
            raise ValueError(f"got {len(session_ids)} session ids for {len(prompts)} prompts")
        request_ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        for request_id, prompt, params, session_id in zip(request_ids, prompts, sampling_params, session_ids):
            self.engine.add_request(request_id, prompt, params, session_id=session_id)
        show = self.engine.config.show_progress if use_tqdm is None else use_tqdm
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", disable=not show) as progress:
            # Steps on until the engine is idle: finished sequences may still be caching their last page.
            while len(finished) < len(request_ids) or self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        outputs = [finished[request_id] for request_id in request_ids]
        self._decode_logprob_tokens(outputs)
        return outputs

    def _decode_logprob_tokens(self, outputs: list[RequestOutput]) -> None:
        """Each Logprob's decoded_token (vLLM's): the token's own text, decoded once per token id."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            return
        texts: dict[int, str] = {}
        for output in outputs:
            entries = [logprobs for completion in output.outputs for logprobs in completion.logprobs or ()]
            for logprobs in [*entries, *(output.prompt_logprobs or ())]:
                for token_id, logprob in (logprobs or {}).items():
                    if token_id not in texts:
                        texts[token_id] = tokenizer.decode([token_id])
                    logprob.decoded_token = texts[token_id]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role": ..., "content": ...} messages) or a list of
        them, each rendered with the model's chat template (or chat_template: a template, a file holding
        one, or the name of one of the model's), then generated as generate() does; one RequestOutput per
        conversation, its .prompt the rendered text. Generation stops on the tokenizer's EOS ids, the template's end-of-turn
        token among them. Every conversation renders before any is queued: a template error (ValueError)
        leaves the engine as it was."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chats; pass token ids to generate()")
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        chat_template = chat_template_argument(tokenizer, chat_template)
        prompts = [
            render_chat(
                tokenizer,
                template_messages(list(conversation)),  # tool calls' arguments as objects, as servers
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **template_variables(chat_template_kwargs),
            )
            for conversation in conversations
        ]
        # The template writes its own BOS where the model wants one.
        token_ids = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
        outputs = self.generate(token_ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt
        return outputs

    def stats(self) -> dict:
        return self.engine.stats()

    def save_checkpoint(self, directory: str) -> None:
        """An orbax checkpoint that LLM(directory) opens again, on this mesh or any other."""
        self.engine.save_checkpoint(directory)

    def rebalance_experts(self, load=None) -> None:
        """Expert parallelism: move experts so device loads even out under `load` (tokens per expert,
        [layers][experts]; default: the load routed so far, as `stats()["expert_tokens"]`). No recompile."""
        self.engine.rebalance_experts(load)

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter directory into a free slot, addressable as `name` (no recompile)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def get_tokenizer(self):
        return self.engine.tokenizer
