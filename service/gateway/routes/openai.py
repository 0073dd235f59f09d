"""``POST /v1/completions`` and ``POST /v1/chat/completions``: validate, then forward the original body."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from squeezeserve.service.gateway import errors
from squeezeserve.service.gateway.deps import ApiKeyDep, ProxyDep, UpstreamsDep
from squeezeserve.service.gateway.metrics import UNKNOWN_MODEL
from squeezeserve.service.gateway.routing import ROUTING_NAMES, RouteRequest
from squeezeserve.service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    validation_message,
)

router = APIRouter(prefix="/v1", dependencies=[ApiKeyDep])
# Per-request routing: a strategy name other than the deployment's, and a session key for prefix_affinity.
ROUTING_HEADER = "x-squeezeserve-routing"
SESSION_HEADER = "x-session-id"


async def _proxy(
    request: Request, proxy: ProxyDep, upstreams: UpstreamsDep, schema: type[SamplingFields], path: str
) -> Response:
    limits = request.scope["state"].get("rate_limits")  # the client's key has limits
    if limits is not None:
        limits.admit()
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise errors.invalid_request(f"We could not parse the JSON body of your request: {exc}.") from None
    if not isinstance(body, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    if isinstance(body.get("model"), str):  # for the log line of a request that is then rejected
        request.state.requested_model = body["model"]
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        raise errors.invalid_request(*validation_message(exc.errors(include_input=False))) from None
    # Bounded metric labels: only models some upstream has listed.
    request.state.model = parsed.model if upstreams.is_known(parsed.model) else UNKNOWN_MODEL
    routing = request.headers.get(ROUTING_HEADER)
    if routing is not None and routing not in ROUTING_NAMES:
        raise errors.invalid_request(
            f"{ROUTING_HEADER} must be one of {', '.join(ROUTING_NAMES)}, not {routing!r}.", ROUTING_HEADER
        )
    route = RouteRequest(
        route=path,
        model=parsed.model,
        request_id=request.state.request_id,
        stream=parsed.stream,
        body=body,
        session_id=request.headers.get(SESSION_HEADER) or None,
        routing=routing,
        key_limits=limits,
    )
    return await proxy.forward(
        route,
        raw,
        request.headers.items(),
        path,
        parsed.include_usage_in_stream,
        client_gone=request.is_disconnected,
    )


@router.post("/completions", response_class=Response)
async def completions(request: Request, proxy: ProxyDep, upstreams: UpstreamsDep) -> Response:
    return await _proxy(request, proxy, upstreams, CompletionRequest, "/v1/completions")


@router.post("/chat/completions", response_class=Response)
async def chat_completions(request: Request, proxy: ProxyDep, upstreams: UpstreamsDep) -> Response:
    return await _proxy(request, proxy, upstreams, ChatCompletionRequest, "/v1/chat/completions")
