"""One error contract for every server squeezeserve runs (gateway and embedded worker): OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status, ``code`` always a string
(or null).

Code raises :class:`APIError` (or a subclass); :func:`install_error_handlers` turns it, FastAPI's request
validation errors and Starlette's own HTTP errors (unknown route 404, wrong method 405) into that shape.
No torch here: the gateway imports it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from squeezeserve.service.protocol import error_body, validation_message

# Starlette's own errors, by status: the code a client can switch on.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
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


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", "invalid_request", param)


def model_not_found(model: str, detail: str = "does not exist") -> APIError:
    return APIError(
        404, f"The model '{model}' {detail}.", "invalid_request_error", "model_not_found", "model"
    )


def server_error(message: str, code: str) -> APIError:
    return APIError(500, message, "server_error", code)


def install_error_handlers(
    app: FastAPI, on_error: Callable[[Request, APIError], Awaitable[None] | None] | None = None
) -> None:
    """Every error ``app`` answers leaves in OpenAI's shape; ``on_error`` sees each one first (metrics,
    logs)."""

    async def answer(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            pending = on_error(request, error)
            if pending is not None:
                await pending
        return error.response()

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)  # registered for this class only
        return await answer(request, exc)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return await answer(request, invalid_request(*validation_message(list(exc.errors()))))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        error = APIError(exc.status_code, str(exc.detail), type_, code, headers=dict(exc.headers or {}))
        return await answer(request, error)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
