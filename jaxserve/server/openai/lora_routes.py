"""vLLM's run-time LoRA routes: POST /v1/load_lora_adapter {lora_name, lora_path} and POST
/v1/unload_lora_adapter {lora_name}. The load or unload runs on the engine loop's thread between steps (it
rewrites device slots); a bad adapter, a name in use, full slots or an unknown name is a 400 naming why,
and the engine keeps serving. A loaded adapter is then a model: its name in a request's `model` field
generates through it, and /v1/models lists it."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from jaxserve.server.openai.context import ServingContext
from jaxserve.server.openai.errors import APIError

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what this server goes by


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    context: ServingContext = request.app.state.context
    if body.lora_name in context.model_names:
        raise APIError(400, f"'{body.lora_name}' is the base model's name; give the adapter another", "lora_name")
    await _on_engine(context, lambda engine: engine.load_lora(body.lora_name, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    context: ServingContext = request.app.state.context
    await _on_engine(context, lambda engine: engine.unload_lora(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _on_engine(context: ServingContext, function):
    loop = context.ready_loop()
    call = getattr(loop, "call", None)
    if call is None or not hasattr(loop.engine, "load_lora"):
        raise APIError(400, "this server does not load LoRA adapters (a router: load them on each replica)")
    try:
        return await asyncio.wrap_future(call(function))
    except ValueError as error:
        raise APIError(400, str(error)) from None
