"""Dependencies routes declare with ``Annotated``: settings, the proxy, the upstream registry, auth.

All are ``async def`` reading what the app built once (FastAPI runs a plain ``def`` dependency in a thread
per request), and none is overridden per app (an override is analysed anew on every request): the settings
come from ``app.state.settings``, which ``create_app`` sets.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from squeezeserve.service.gateway.config import GatewaySettings
from squeezeserve.service.gateway.errors import unauthorized
from squeezeserve.service.gateway.metrics import GatewayMetrics
from squeezeserve.service.gateway.proxy import Proxy
from squeezeserve.service.gateway.upstreams import UpstreamRegistry


async def _settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


async def _proxy(request: Request) -> Proxy:
    return request.app.state.proxy


async def _upstreams(request: Request) -> UpstreamRegistry:
    return request.app.state.upstreams


async def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


SettingsDep = Annotated[GatewaySettings, Depends(_settings)]
ProxyDep = Annotated[Proxy, Depends(_proxy)]
UpstreamsDep = Annotated[UpstreamRegistry, Depends(_upstreams)]
MetricsDep = Annotated[GatewayMetrics, Depends(_metrics)]


async def require_api_key(
    request: Request, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """401 unless API keys are off or ``Authorization: Bearer <key>`` names one (constant-time compare).

    A key with limits is noted in the request's state (``rate_limits``): the middleware puts its
    ``x-ratelimit-*`` headers on the response, and the completion routes count the request against it."""
    if not settings.api_keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token_bytes = token.strip().encode()
    matched = next(
        (entry.key for entry in settings.api_keys if hmac.compare_digest(token_bytes, entry.key.encode())),
        None,
    )
    if scheme.lower() != "bearer" or matched is None:
        raise unauthorized()
    key_limits = request.app.state.key_limits
    if key_limits:
        limits = key_limits.get(matched)
        if limits is not None:
            request.scope["state"]["rate_limits"] = limits


ApiKeyDep = Depends(require_api_key)
