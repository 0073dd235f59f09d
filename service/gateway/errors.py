"""The gateway's errors: named constructors over the shared OpenAI error contract (``service/errors.py``,
which the worker installs too), and the handlers that also count each rejection and log the model the
client asked for.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request

from squeezeserve.service.errors import APIError
from squeezeserve.service.errors import install_error_handlers as install_shared_handlers

log = logging.getLogger(__name__)


class GatewayError(APIError):
    """An error the gateway answers with (the shared :class:`~squeezeserve.service.errors.APIError`)."""


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", "invalid_request", param)


def body_too_large(limit: int) -> GatewayError:
    message = f"The request body is larger than this gateway accepts ({limit} bytes)."
    return GatewayError(413, message, "invalid_request_error", "request_too_large")


def unauthorized() -> GatewayError:
    return GatewayError(
        401,
        "Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model '{model}' does not exist or is not served by any upstream.",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def overloaded(retry_after_seconds: int) -> GatewayError:
    return GatewayError(
        429,
        "Every upstream serving this model is at its in-flight limit; retry shortly.",
        "rate_limit_error",
        "rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_seconds)},
    )


def rate_limited(kind: str, limit: int, retry_after_seconds: int) -> GatewayError:
    """A key over its limit; ``kind`` is ``requests`` or ``tokens``, OpenAI's error type for each."""
    return GatewayError(
        429,
        f"Rate limit reached for {kind} per minute (limit {limit}) on this API key; "
        f"retry in {retry_after_seconds} s.",
        kind,
        "rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_seconds)},
    )


def no_healthy_upstream(model: str) -> GatewayError:
    return GatewayError(
        503,
        f"No healthy upstream is serving the model '{model}' right now.",
        "service_unavailable",
        "no_healthy_upstream",
    )


def no_healthy_upstream_at_all(configured: int) -> GatewayError:
    return GatewayError(
        503, f"None of the {configured} upstreams is healthy.", "service_unavailable", "no_healthy_upstream"
    )


def upstream_timeout(seconds: float) -> GatewayError:
    return GatewayError(
        504, f"The upstream did not answer within {seconds:g} seconds.", "timeout", "upstream_timeout"
    )


def bad_gateway(message: str) -> GatewayError:
    return GatewayError(502, message, "upstream_error", "bad_gateway")


def _count_and_log(request: Request, error: APIError) -> None:
    """Count the rejection, and name the model the client asked for (never keys, headers or prompts)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.rejections.labels(error.code or error.type).inc()
    requested = getattr(request.state, "requested_model", None)
    log.info(
        "rejected %s %s model=%s status=%d code=%s",
        request.method,
        request.url.path,
        "-" if requested is None else repr(requested[:100]),
        error.status,
        error.code,
    )


def install_error_handlers(app: FastAPI) -> None:
    install_shared_handlers(app, _count_and_log)


# OpenAI's error shape as an OpenAPI schema, for the statuses each route documents.
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def documented(statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for ``statuses`` (status: description), each with the error body."""
    content = {"application/json": {"schema": ERROR_SCHEMA}}
    return {status: {"description": text, "content": content} for status, text in statuses.items()}
