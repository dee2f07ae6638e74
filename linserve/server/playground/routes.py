"""``GET /`` (the playground), its static files, and ``/docs`` / ``/redoc`` served from the
``fastapi-offline`` package's copies of Swagger UI and ReDoc instead of a CDN."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
DOCS_ASSETS = Path(fastapi_offline.__file__).with_name("static")
# The playground runs only its own files: no inline script or style, no eval, no framing.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data: blob:; connect-src 'self'; "
                               "object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
router = APIRouter(include_in_schema=False)
# ReDoc's bundle shows a logo from its vendor's CDN; this copy shows ours instead, so the
# docs make no request off the server.
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


@cache
def redoc_bundle() -> bytes:
    text = (DOCS_ASSETS / "redoc.standalone.js").read_text(encoding="utf-8")
    return text.replace(REDOC_LOGO, "/playground/favicon.svg").encode()


@router.get("/")
async def playground() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url, title="linserve API",
        swagger_js_url="/static/docs/swagger-ui-bundle.js",
        swagger_css_url="/static/docs/swagger-ui.css",
        swagger_favicon_url="/static/docs/favicon.png")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url=request.app.openapi_url, title="linserve API",
                          redoc_js_url="/static/redoc.standalone.js",
                          redoc_favicon_url="/static/docs/favicon.png", with_google_fonts=False)


@router.get("/static/redoc.standalone.js")
async def redoc_js() -> Response:
    return Response(redoc_bundle(), media_type="text/javascript",
                    headers={"X-Content-Type-Options": "nosniff",
                             "Cache-Control": "public, max-age=86400"})


class NoSniffFiles(StaticFiles):
    """Static files with ``X-Content-Type-Options: nosniff``."""

    def file_response(self, *args: object, **kwargs: object) -> FileResponse:
        response = super().file_response(*args, **kwargs)  # type: ignore[arg-type]
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response  # type: ignore[return-value]


def install_playground(app: FastAPI) -> None:
    """Add the page, its files and the offline docs to ``app`` (made with docs_url=None)."""
    app.include_router(router)
    app.mount("/playground", NoSniffFiles(directory=STATIC), name="playground")
    app.mount("/static/docs", NoSniffFiles(directory=DOCS_ASSETS), name="docs-assets")
