"""The ASGI app: the OpenAI routes (completions.py, chat.py, responses_api.py) and vLLM's side routes (/v1/models,
/tokenize, /detokenize, /tokenizer_info, /health, /metrics), behind the guard (API keys, body size) and, when
server.cors_allowed_origins names any, CORS."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

import jaxserve
from jaxserve.server import limits as request_limits
from jaxserve.server.auth import ApiKeys
from jaxserve.server.chat_prompt import chat_prompt_token_ids
from jaxserve.server.openai import chat, completions, lora_routes, responses_api
from jaxserve.server.openai.context import ServingContext
from jaxserve.server.openai.errors import APIError, error_response, install_error_handlers
from jaxserve.server.openai.guard import Guard
from jaxserve.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.server.tool_choice import template_messages


def build_app(
    context: ServingContext,
    api_keys: ApiKeys | None,
    max_message_bytes: int,
    cors_allowed_origins: tuple[str, ...] = (),
) -> ASGIApp:
    """cors_allowed_origins: server.cors_allowed_origins, the browser origins (or "*") whose pages may
    call the API; none: no CORS headers, so browsers keep other sites' pages out."""
    app = FastAPI(title="jaxserve", version=jaxserve.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.context = context
    install_error_handlers(app, context.on_refusal)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses_api.router)
    app.include_router(lora_routes.router)

    @app.get("/health")
    async def health():
        try:
            context.ready_loop()
        except APIError as error:  # 503 while warming up or draining; a probe is not a refused request
            return error_response(error.status, error.message)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        loop = context.ready_loop()
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": context.created,
                    "owned_by": "jaxserve",
                    "root": context.checkpoint_name,
                    "parent": None,
                    "max_model_len": loop.description.max_model_len,
                }
                for name in context.model_names
            ]
            + [  # LoRA adapters, as vLLM lists them: the adapter's directory as root, the base model as parent
                {
                    "id": adapter["name"],
                    "object": "model",
                    "created": context.created,
                    "owned_by": "jaxserve",
                    "root": adapter["path"],
                    "parent": context.model_name,
                    "max_model_len": loop.description.max_model_len,
                }
                for adapter in context.lora_adapters()
            ],
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        context.ready_loop()
        context.check_model(body.model)
        token_ids = await context.run(tokenized, context, body)
        return {"count": len(token_ids), "max_model_len": context.limits.max_prompt_tokens, "tokens": token_ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        context.ready_loop()
        context.check_model(body.model)
        return {"prompt": await context.run(detokenized, context, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the tokenizer's special tokens and chat template, what lm-evaluation-harness's remote
        tokenizer reads (with /tokenize and /detokenize) instead of downloading the model's tokenizer."""
        loop = context.ready_loop()
        tokenizer = context.tokenizer
        special = {
            name: tokenizer.special_tokens.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return {
            "tokenizer_class": type(tokenizer).__name__,
            **special,
            # the template chats are rendered with: the server's chat_template when it sets one
            "chat_template": context.chat_template if context.chat_template is not None else tokenizer.chat_template,
            "model_max_length": loop.description.max_model_len,
        }

    guard = Guard(app, api_keys, max_message_bytes, context.on_refusal)
    if not cors_allowed_origins:
        return guard
    # Outside the guard: a browser's preflight (OPTIONS) carries no API key, and a refusal (401, 413)
    # needs the CORS headers too, or the page cannot read why it was refused.
    return CORSMiddleware(guard, allow_origins=list(cors_allowed_origins), allow_methods=["*"], allow_headers=["*"])


def tokenized(context: ServingContext, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None and body.messages is None:
        request_limits.check_text(context.limits, body.prompt, "prompt")
        return context.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    if body.messages is not None and body.prompt is None:
        return chat_prompt_token_ids(  # as /v1/chat/completions renders them (chat.py:checked_chat)
            context.tokenizer,
            context.limits,
            template_messages(body.messages),
            context.chat_template,
            body.add_generation_prompt,
            body.continue_final_message,
            body.tools,
            body.chat_template_kwargs,
        )
    raise APIError(400, "give exactly one of prompt and messages")


def detokenized(context: ServingContext, token_ids: list[int]) -> str:
    limits = context.limits
    request_limits.check_token_ids(limits, token_ids, "the request")
    outside = [t for t in token_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise APIError(400, f"token ids {outside[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    return context.tokenizer.decode(token_ids, skip_special_tokens=True)
