"""The OpenAPI document, completed with what depends on the loaded model and settings.

Token ids get the vocabulary's bounds, ``max_tokens`` the configured limit, and plain-text
responses their content type, so schema-based fuzzers (schemathesis) can check conformance,
not only the absence of 5xx.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from linserve.server.api.protocol import REFUSED


def id_pattern(n: int) -> str:
    """A regex of the decimal integers 0 … n-1, no leading zeros (token ids as JSON keys)."""
    top = str(n - 1)
    k = len(top)
    alts = ["0"] if n > 0 else []
    if k >= 2:
        alts.append(f"[1-9][0-9]{{0,{k - 2}}}")
    for i, digit in enumerate(top):
        lo = 1 if i == 0 else 0
        if int(digit) > lo:
            alts.append(f"{top[:i]}[{lo}-{int(digit) - 1}][0-9]{{{k - i - 1}}}")
    alts.append(top)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


# Constraints pydantic leaves in its own names where a before-validator wraps the type.
_JSON_SCHEMA_NAMES = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum",
                      "lt": "exclusiveMaximum"}


# A refused field (server.api.protocol.REFUSED) is accepted only when empty.
REFUSED_SCHEMA: dict[str, Any] = {
    "enum": [None, False, [], {}],
    "description": "not supported by this server: any other value is a 400 naming the field"}


def _patch(node: Any, vocab_size: int, max_tokens: int) -> None:
    if isinstance(node, dict):
        if node.pop("x-refused", False):
            node.setdefault("properties", {}).update({n: REFUSED_SCHEMA for n in REFUSED})
        if node.get("type") in ("integer", "number"):
            for ours, theirs in _JSON_SCHEMA_NAMES.items():
                if ours in node:
                    node.setdefault(theirs, node.pop(ours))
        if node.pop("x-token-id-keys", False):
            node["propertyNames"] = {"pattern": id_pattern(vocab_size)}
        if node.pop("x-token-id", False):
            node.pop("ge", None)
            node["minimum"], node["maximum"] = 0, vocab_size - 1
        if node.pop("x-max-tokens", False):
            node["maximum"] = max_tokens
        for value in node.values():
            _patch(value, vocab_size, max_tokens)
    elif isinstance(node, list):
        for value in node:
            _patch(value, vocab_size, max_tokens)


def install_openapi(app: FastAPI, vocab_size: int, max_tokens: int) -> None:
    """Replace ``app.openapi`` with a generator that fills in model-dependent limits."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            _patch(schema, vocab_size, max_tokens)
            metrics = schema["paths"].get("/metrics", {}).get("get")
            if metrics is not None:
                metrics["responses"]["200"]["content"] = {
                    "text/plain": {"schema": {"type": "string"}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
