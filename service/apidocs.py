"""``/docs`` from files that ship with the package (Swagger UI, ``service/static/swagger-ui``), not from a
CDN: the API reference works on a machine with no internet access. FastAPI's own ``/docs`` and ``/redoc``
load their scripts from jsDelivr, so both are replaced."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(__file__).parent / "static" / "swagger-ui"
ASSETS_URL = "/docs/assets"


def create_app_with_offline_docs(**fastapi_kwargs: object) -> FastAPI:
    """``FastAPI(**fastapi_kwargs)`` whose ``/docs`` serves the bundled Swagger UI (and no ``/redoc``)."""
    app = FastAPI(docs_url=None, redoc_url=None, **fastapi_kwargs)  # type: ignore[arg-type]
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API reference",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon-32x32.png",
        )

    return app
