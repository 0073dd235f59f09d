"""``create_app(settings)``: assemble the gateway. Nothing here but wiring."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from squeezeserve.service import __version__
from squeezeserve.service.apidocs import create_app_with_offline_docs
from squeezeserve.service.gateway.config import GatewaySettings, get_settings
from squeezeserve.service.gateway.errors import install_error_handlers
from squeezeserve.service.gateway.metrics import GatewayMetrics
from squeezeserve.service.gateway.middleware import RequestContextMiddleware
from squeezeserve.service.gateway.proxy import Proxy
from squeezeserve.service.gateway.ratelimit import build_key_limits
from squeezeserve.service.gateway.routes import health, models, openai
from squeezeserve.service.gateway.routing import build_strategy
from squeezeserve.service.gateway.upstream_http import UpstreamPool
from squeezeserve.service.gateway.upstreams import UpstreamRegistry


def _probe_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """For health checks only (a few requests a minute); the proxy sends through ``UpstreamPool``."""
    # trust_env=False: upstreams are internal; an HTTP(S)_PROXY meant for the internet must not apply.
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=settings.connect_timeout), trust_env=False)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway app for ``settings`` (default: ``get_settings()``, from the environment)."""
    settings = settings if settings is not None else get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = UpstreamPool(settings.connect_timeout)
        async with _probe_client(settings) as client:
            key = settings.upstream_api_key
            probe_headers = {"authorization": f"Bearer {key}"} if key else {}
            upstreams = UpstreamRegistry(
                settings.upstreams,
                client,
                health_interval=settings.health_interval,
                health_timeout=settings.health_timeout,
                unhealthy_threshold=settings.unhealthy_threshold,
                headers=probe_headers,
                on_unresponsive=pool.abort,
            )
            metrics = GatewayMetrics()
            app.state.upstreams = upstreams
            app.state.metrics = metrics
            app.state.proxy = Proxy(pool, upstreams, build_strategy(settings), metrics, settings)
            await upstreams.start()
            metrics.watch_upstreams(upstreams)  # after the first probes: what it publishes is known
            try:
                yield
            finally:
                await upstreams.stop()
                await pool.aclose()
                metrics.close()

    app = create_app_with_offline_docs(title="squeezeserve gateway", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.key_limits = build_key_limits(settings)
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware)
    app.include_router(openai.router)
    app.include_router(models.router)
    app.include_router(health.router)
    build_openapi = app.openapi
    app.openapi = lambda: app.openapi_schema or openai.document_bodies(build_openapi())  # type: ignore[method-assign]
    return app
