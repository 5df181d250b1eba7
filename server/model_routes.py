"""Admin routes of the model registry: load and unload versions, switch aliases, load and unload LoRA adapters.

    POST   /v1/models                  load name@version from a path ([[models]] keys as JSON)
    DELETE /v1/models/{id}             drain its running requests, then free it
    POST   /v1/models/aliases          point an alias at a ready version (optionally warmed first)
    POST   /v1/load_lora_adapter       vLLM's route: load a PEFT adapter onto a model
    POST   /v1/unload_lora_adapter     vLLM's route: unload it (its running requests finish first)

Every route needs an admin key when admin keys are configured.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from litestar import Request, delete, post
from litestar.params import FromPath, JSONBody
from pydantic import BaseModel, ConfigDict, Field

from tierserve.core.errors import RequestError
from tierserve.core.sections import MODEL_NAME, ModelEntry
from tierserve.server.errors import APIError
from tierserve.server.openai_routes import model_entry
from tierserve.server.state import state_of

log = structlog.get_logger(__name__)


class AliasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    alias: str = Field(pattern=MODEL_NAME.pattern, description="the alias to point (created when new)")
    model: str = Field(description="the version it points at from now on (name@version)")
    warm: bool = Field(False, description="first replay the old version's most used prompts on the new one")


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=MODEL_NAME.pattern, description="the name requests send as 'model'")
    lora_path: str = Field(min_length=1, description="a PEFT LoRA adapter directory")
    model: str | None = Field(None, description="the base model version or alias (default: the default model)")


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM clients send it; names are unique here, so it selects nothing


@post("/v1/models", opt={"admin": True}, status_code=201)
async def load_model(request: Request, data: JSONBody[ModelEntry]) -> dict[str, Any]:
    """Load a model version; answers once it is ready (201), 409 past ``[registry]`` limits."""
    state = state_of(request)
    served = await asyncio.to_thread(state.registry.add_and_load, data)
    return model_entry(state, served.id)


@delete("/v1/models/{model_id:str}", opt={"admin": True}, status_code=200)
async def unload_model(request: Request, model_id: FromPath[str]) -> dict[str, Any]:
    """Stop routing to a version, let its running requests finish, then free it."""
    state = state_of(request)
    timeout = state.settings.server.shutdown_grace_seconds
    drained = await asyncio.to_thread(state.registry.unload, model_id, timeout)
    return {"id": model_id, "object": "model", "deleted": True, "drained_requests": drained}


@post("/v1/models/aliases", opt={"admin": True}, status_code=200)
async def switch_alias(request: Request, data: JSONBody[AliasRequest]) -> dict[str, Any]:
    """Point an alias at another ready version; requests already running stay where they are."""
    registry = state_of(request).registry
    warmed = 0
    if data.warm:
        target = registry.lookup(data.model).served
        prompts = registry.top_prompts(registry.aliases.get(data.alias), registry.settings.registry.warm_prompts_on_switch)
        warmed = await asyncio.to_thread(registry.warm_with, prompts, target)
    previous = registry.switch_alias(data.alias, data.model)
    return {"alias": data.alias, "model": data.model, "previous": previous, "warmed_prompts": warmed}


@post("/v1/load_lora_adapter", opt={"admin": True}, status_code=200)
async def load_lora_adapter(request: Request, data: JSONBody[LoadLoraRequest]) -> dict[str, Any]:
    """Load a PEFT adapter onto a model; requests name it in ``model`` from now on."""
    state = state_of(request)
    registry = state.registry
    taken = data.lora_name in registry.models or data.lora_name in registry.aliases
    if taken or any(m.engine is not None and data.lora_name in m.engine.loras for m in registry.models.values()):
        raise APIError(400, f"lora_name: {data.lora_name!r} is already a served model name or adapter",
                       param="lora_name", code="invalid_value")  # fmt: skip
    target = state.target(data.model)
    if target.lora_name is not None:
        raise APIError(400, f"model: {data.model!r} is itself a LoRA adapter; name its base model",
                       param="model", code="invalid_value")  # fmt: skip
    try:
        info = await asyncio.to_thread(target.engine.load_lora, data.lora_name, data.lora_path)
    except RequestError as exc:
        raise APIError(400, exc.message, param=exc.param, code=exc.code) from None
    return {"lora_name": data.lora_name, "model": target.served.id, **info}


@post("/v1/unload_lora_adapter", opt={"admin": True}, status_code=200)
async def unload_lora_adapter(request: Request, data: JSONBody[UnloadLoraRequest]) -> dict[str, Any]:
    """Unload an adapter: new requests naming it get 404 at once; its running ones finish first."""
    registry = state_of(request).registry
    target = registry.lookup(data.lora_name)
    if target.lora_name is None:
        raise APIError(404, f"lora_name: no LoRA adapter named {data.lora_name!r} is loaded", param="lora_name",
                       code="lora_not_found")  # fmt: skip
    running = await asyncio.to_thread(target.engine.unload_lora, data.lora_name)
    return {"lora_name": data.lora_name, "model": target.served.id, "unloaded": True, "running_requests": running}


ROUTES = [load_model, unload_model, switch_alias, load_lora_adapter, unload_lora_adapter]
