"""``POST /v1/completions`` and ``POST /v1/chat/completions``: validate, then forward the original body."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema

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
from squeezeserve.service.serving import until_disconnected

router = APIRouter(prefix="/v1", dependencies=[ApiKeyDep])
# The body is read raw (forwarded as sent), so FastAPI cannot infer its schema: named here, defined in the
# components by ``document_bodies``, with the OpenAI-shaped error every failure answers.
REQUEST_SCHEMAS: tuple[type[SamplingFields], ...] = (CompletionRequest, ChatCompletionRequest)
ERROR_RESPONSES = errors.documented(
    {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model", 413: "Body too large"}
    | {429: "Overloaded", 502: "Upstream failed", 503: "No upstream ready", 504: "Upstream timed out"}
)


def _body(schema: type[SamplingFields]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def document_bodies(openapi: dict[str, Any]) -> dict[str, Any]:
    """``openapi`` with the request schemas ``_body`` refers to added to its components."""
    _, defs = models_json_schema(
        [(schema, "validation") for schema in REQUEST_SCHEMAS], ref_template="#/components/schemas/{model}"
    )
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return openapi


# Per-request routing: a strategy name other than the deployment's, and a session key for prefix_affinity.
ROUTING_HEADER = "x-squeezeserve-routing"
SESSION_HEADER = "x-session-id"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` bytes (from its length header, or while
    it arrives), so an oversized one is never held in memory whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise errors.body_too_large(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise errors.body_too_large(limit)
        parts.append(part)
    return b"".join(parts)


async def _proxy(
    request: Request, proxy: ProxyDep, upstreams: UpstreamsDep, schema: type[SamplingFields], path: str
) -> Response:
    limits = request.scope["state"].get("rate_limits")  # the client's key has limits
    if limits is not None:
        limits.admit()
    raw = await _read_body(request, proxy.max_body_bytes)
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
        client_gone=lambda: until_disconnected(request.receive),
    )


@router.post(
    "/completions", response_class=Response, openapi_extra=_body(CompletionRequest), responses=ERROR_RESPONSES
)
async def completions(request: Request, proxy: ProxyDep, upstreams: UpstreamsDep) -> Response:
    return await _proxy(request, proxy, upstreams, CompletionRequest, "/v1/completions")


@router.post(
    "/chat/completions",
    response_class=Response,
    openapi_extra=_body(ChatCompletionRequest),
    responses=ERROR_RESPONSES,
)
async def chat_completions(request: Request, proxy: ProxyDep, upstreams: UpstreamsDep) -> Response:
    return await _proxy(request, proxy, upstreams, ChatCompletionRequest, "/v1/chat/completions")
