"""Optional Bearer API keys. Without keys the server is open and every caller shares the
owner ''. With keys, a caller's owner id is a hash of its key, and sessions are visible only
to their owner."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from linserve.server.api.errors import APIError
from linserve.server.sessions.store import owner_hash


def require_owner(request: Request) -> str:
    """FastAPI dependency: check the Bearer key, or Anthropic's ``x-api-key`` header (if
    keys are configured); return the owner."""
    keys: set[str] = request.app.state.api_keys
    if not keys:
        return ""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else ""
    key = key or request.headers.get("x-api-key", "").strip()  # Anthropic's header
    if not key:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or "
                       "'x-api-key: <key>'", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})
    if not any(hmac.compare_digest(key, k) for k in keys):
        raise APIError(401, "invalid API key", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})
    return owner_hash(key)


Owner = Annotated[str, Depends(require_owner)]
