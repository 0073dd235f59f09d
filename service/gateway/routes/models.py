"""``GET /v1/models``: the union of the models the healthy upstreams serve; ``GET /v1/models/{id}``: one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from squeezeserve.service.gateway import errors
from squeezeserve.service.gateway.deps import ApiKeyDep, UpstreamsDep

router = APIRouter(
    prefix="/v1",
    dependencies=[ApiKeyDep],
    responses=errors.documented({401: "Missing or wrong API key", 404: "Unknown model"}),
)


@router.get("/models")
async def list_models(upstreams: UpstreamsDep) -> dict[str, Any]:
    return {"object": "list", "data": upstreams.models()}


# ``:path``: model ids may contain slashes (Hugging Face ids such as org/name).
@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, upstreams: UpstreamsDep) -> dict[str, Any]:
    for card in upstreams.models():
        if card.get("id") == model_id:
            return card
    raise errors.model_not_found(model_id)
