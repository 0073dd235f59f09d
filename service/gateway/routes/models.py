"""``GET /v1/models``: the union of the models the healthy upstreams serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from squeezeserve.service.gateway.deps import ApiKeyDep, UpstreamsDep

router = APIRouter(prefix="/v1", dependencies=[ApiKeyDep])


@router.get("/models")
async def list_models(upstreams: UpstreamsDep) -> dict[str, Any]:
    return {"object": "list", "data": upstreams.models()}
