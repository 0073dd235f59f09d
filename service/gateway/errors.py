"""The gateway's one error contract: OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Code anywhere in the gateway raises :class:`GatewayError` (or one of the named constructors below); the
handlers installed by :func:`install_error_handlers` turn it, FastAPI's and Starlette's own errors into
that shape with the right status.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from squeezeserve.service.protocol import error_body, validation_message


class GatewayError(Exception):
    """An error the client should see: HTTP status plus OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", "invalid_request", param)


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


async def _gateway_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)  # registered for this class only
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.rejections.labels(exc.code or exc.type).inc()
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(list(exc.errors()))
    return invalid_request(message, param).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(
        error_body(str(exc.detail), type_, exc.status_code), status_code=exc.status_code, headers=exc.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
