"""OpenAPI descriptions shared by the routers: every error status and the SSE responses."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from linserve.server.api.protocol import ErrorResponse


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error envelope (the /v1/messages routes)."""

    type: str = "error"
    error: AnthropicErrorBody

_ERR = {"model": ErrorResponse}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERR, "description": "Invalid request"},
    401: {**_ERR, "description": "Missing or invalid API key"},
    404: {**_ERR, "description": "Unknown session"},
    409: {**_ERR, "description": "Session busy"},
    413: {**_ERR, "description": "Request body too large"},
    429: {**_ERR, "description": "Server at capacity", "headers": {
        "Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}},
    503: {**_ERR, "description": "Session store unavailable"},
}
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {**doc, "model": AnthropicError} for status, doc in ERRORS.items()}
SSE_RESPONSE: dict[str, Any] = {
    "description": "JSON when stream is false; with stream true, server-sent events: "
                   "'data: {chunk}' frames, optional ': keep-alive' comments, then "
                   "'data: [DONE]'.",
    "content": {"application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {
                    "type": "object", "description": "one server-sent event",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                   "id": {"type": "string"}}}}},
}
