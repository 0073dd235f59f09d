"""Probes and metrics, open without an API key: ``/livez``, ``/readyz``, ``/health``, ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from squeezeserve.service.gateway import errors
from squeezeserve.service.gateway.deps import MetricsDep, UpstreamsDep

router = APIRouter()


@router.get("/livez")
async def livez() -> dict[str, str]:
    """The process is up (restart it if not); says nothing about the upstreams."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(upstreams: UpstreamsDep) -> JSONResponse:
    """200 while at least one upstream is healthy (send traffic here), else 503."""
    healthy = len(upstreams.healthy())
    if not healthy:
        return errors.no_healthy_upstream_at_all(len(upstreams.upstreams)).response()
    return JSONResponse({"status": "ok", "healthy_upstreams": healthy, "upstreams": len(upstreams.upstreams)})


@router.get("/health")
async def health(upstreams: UpstreamsDep) -> JSONResponse:
    """The same as ``/readyz``, under the name OpenAI-compatible servers use."""
    return await readyz(upstreams)


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
