"""/docs and /redoc from packaged files, so that the API pages work with no internet.

FastAPI's own pages load Swagger UI and ReDoc from a CDN: on an air-gapped host, or behind a
proxy that blocks it, they stay blank. The fastapi-offline wheel ships the same files (Swagger UI
5, which renders the OpenAPI 3.1 that FastAPI writes, and ReDoc 2); they are served from
/docs/assets and both pages point there. Nothing on either page is fetched from elsewhere.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs/assets"
ASSETS_DIR = Path(
    str(files("fastapi_offline") / "static")
)  # swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png


def serve_docs_offline(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Add /docs (with its OAuth2 redirect), /redoc and their assets to an app made with docs_url=None, redoc_url=None."""
    assert app.docs_url is None and app.redoc_url is None, "FastAPI's CDN pages are still on. This is a bug."
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url or f"{docs_url}/oauth2-redirect"
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy that strips a prefix
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + oauth2_redirect_url,
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            # No validator badge: Swagger UI would fetch it from validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
        )

    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )

    app.add_api_route(docs_url, swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(oauth2_redirect_url, oauth2_redirect, methods=["GET"], include_in_schema=False)
    app.add_api_route(redoc_url, redoc, methods=["GET"], include_in_schema=False)
