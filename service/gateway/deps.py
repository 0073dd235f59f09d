"""Dependencies routes declare with ``Annotated``: settings, the proxy, the upstream registry, auth."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from squeezeserve.service.gateway.config import GatewaySettings, get_settings
from squeezeserve.service.gateway.errors import unauthorized
from squeezeserve.service.gateway.metrics import GatewayMetrics
from squeezeserve.service.gateway.proxy import Proxy
from squeezeserve.service.gateway.upstreams import UpstreamRegistry

SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]


def _proxy(request: Request) -> Proxy:
    return request.app.state.proxy


def _upstreams(request: Request) -> UpstreamRegistry:
    return request.app.state.upstreams


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


ProxyDep = Annotated[Proxy, Depends(_proxy)]
UpstreamsDep = Annotated[UpstreamRegistry, Depends(_upstreams)]
MetricsDep = Annotated[GatewayMetrics, Depends(_metrics)]


def require_api_key(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """401 unless API keys are off or ``Authorization: Bearer <key>`` names one (constant-time compare)."""
    if not settings.api_keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token_bytes = token.strip().encode()
    if scheme.lower() != "bearer" or not any(
        hmac.compare_digest(token_bytes, key.encode()) for key in settings.api_keys
    ):
        raise unauthorized()


ApiKeyDep = Depends(require_api_key)
