"""`GET /v1/models` and `GET /v1/models/{model}`: the models this process serves, as OpenAI's `Model` objects
(plus `max_model_len`, the context length in tokens). The OpenAPI document states their shape."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from lora import adapters
from http_api.openai_errors import APIError
from ingress.context import Context
from ingress.serving.served_model import ServedModel

router = APIRouter()


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


def model_object(name: str, model: ServedModel) -> dict:
    return {"id": name, "object": "model", "created": model.created, "owned_by": "tokenmill",
            "max_model_len": model.max_model_len}


def adapter_object(manifest, context) -> dict | None:
    """A tenant's LoRA adapter as a model: owned by its tenant, the base model's context length."""
    base = context.models.get(manifest["base_model"])
    if base is None:
        return None
    return {"id": adapters.model_id(manifest["base_model"], manifest["name"]), "object": "model",
            "created": manifest["created_ms"] // 1000, "owned_by": manifest["tenant_id"],
            "max_model_len": base.max_model_len}


@router.get("/v1/models", responses={200: {"model": ModelList, "description": "The served models"}})
async def list_models(request: Request, context: Context):
    caller = context.authenticator.caller(request.headers)
    data = [model_object(name, m) for name, m in context.models.items()]
    # the caller's own adapters only: another tenant's are not listed, as they do not exist for it
    data += [o for m in context.adapters.catalog.of_tenant(caller.tenant_id) if (o := adapter_object(m, context))]
    return {"object": "list", "data": data}


# `:path`: a served model's name may hold a slash (`org/model`), as Hugging Face names do
@router.get("/v1/models/{model:path}", responses={200: {"model": ModelObject, "description": "The model"}})
async def retrieve_model(request: Request, model: str, context: Context):
    caller = context.authenticator.caller(request.headers)
    served = context.models.get(model)
    if served is None:
        manifest = context.adapters.catalog.resolve(caller.tenant_id, model)
        found = adapter_object(manifest, context) if manifest is not None else None
        if found is not None:
            return found
        raise APIError(404, f"The model '{model}' does not exist.", code="model_not_found", param="model")
    return model_object(model, served)
