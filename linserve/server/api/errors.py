"""Errors in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause maps to a 4xx here; anything unexpected becomes a bare 500
with no stack trace or internal path in the body (and is logged server-side).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("linserve.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """Raise anywhere in a handler to answer with this status and envelope."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


# Anthropic's error types by status (its Messages API answers in its own envelope).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's envelope ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {
        "type": _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                     else "api_error"), "message": message}}


def body_for(path: str, status: int, message: str, param: str | None = None,
             code: str | None = None) -> dict[str, Any]:
    """The error body in the envelope of the API that ``path`` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_body(status, message)
    return error_body(status, message, param, code)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    return JSONResponse(body_for(path, status, message, param, code), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    msg = str(first.get("msg", "invalid value"))
    return (f"{param}: {msg}" if param else msg), param


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route serves at ``path`` (for the Allow header of a 405)."""
    methods: set[str] = set()
    for route in app.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods - {"HEAD"})


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every exception into the OpenAI envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers,
                              request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {"Allow": ", ".join(allowed_methods(app, request.url.path))}
        return error_response(exc.status_code, str(exc.detail), None, None, headers,
                              request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", None, "internal_error",
                              path=request.url.path)
