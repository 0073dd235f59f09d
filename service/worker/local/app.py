"""``create_app(loaded, settings)``: assemble the embedded worker's OpenAI-compatible app. Wiring only.

Routes (``routes.py``) turn requests into engine work and answers (``responses.py``); generation runs on
the engine thread, never on the event loop; a client that disconnects cancels its request, and the engine
drops it at the next step. Every error is answered in OpenAI's shape (``service/errors.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from squeezeserve.service.apidocs import create_app_with_offline_docs
from squeezeserve.service.errors import APIError, install_error_handlers
from squeezeserve.service.models.loader import LoadedModel
from squeezeserve.service.worker.local import routes
from squeezeserve.service.worker.local.service import WorkerService
from squeezeserve.service.worker.settings import WorkerSettings


def _count_error(request: Request, error: APIError) -> None:
    # Labelled by the matched route's template (bounded), so unknown paths are not counted.
    route = getattr(request.scope.get("route"), "path", None)
    if route is not None:
        request.app.state.service.metrics.requests.labels(endpoint=route, status=str(error.status)).inc()


def create_app(loaded: LoadedModel, settings: WorkerSettings) -> FastAPI:
    service = WorkerService(loaded, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        try:
            yield
        finally:
            service.engine.stop()

    app = create_app_with_offline_docs(title="squeezeserve embedded worker", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app, on_error=_count_error)
    app.include_router(routes.router)
    return app
