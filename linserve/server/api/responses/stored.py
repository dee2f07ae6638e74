"""Stored responses: a response kept with ``store: true`` is a session (in the memory or
Redis session store, owned by the API key, with the sessions' TTL and byte budget) whose
state is the conversation after its reply, and whose ``meta`` holds the Response object,
its input items and the conversation's instructions.

``previous_response_id`` forks that session (states are never mutated in place, so the fork
shares the tensors): two requests that name the same response each continue from it.
"""

from __future__ import annotations

import secrets
from typing import Any

from linserve.server.api.errors import APIError
from linserve.server.api.responses.items import Item
from linserve.server.api.service import GenerationService
from linserve.server.sessions.store import Session, SessionUnavailable

_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


async def load(svc: GenerationService, rid: str, owner: str, param: str = "response_id"
               ) -> Session:
    """The session of stored response ``rid``: 404 unknown, foreign or not stored."""
    try:
        sess = await svc.store.get(rid, owner)
    except SessionUnavailable as exc:
        raise APIError(503, "session store unavailable", param) from exc
    meta = sess.meta if sess is not None else None
    if sess is None or meta is None or not meta.get("response", {}).get("store", False):
        raise APIError(404, f"response {rid!r} not found", param)
    return sess


def input_records(items: list[Item]) -> list[dict[str, Any]]:
    """The input items as ``GET /v1/responses/{id}/input_items`` lists them (with ids)."""
    out = []
    for item in items:
        record = item.model_dump(exclude_none=True)
        prefix = _ITEM_PREFIX[record.get("type", "message")]
        record.setdefault("type", "message")
        if record["type"] == "message":
            record["content"] = _parts(item.model_dump()["content"], record["role"])
            record.setdefault("status", "completed")
        record["id"] = record.get("id") or f"{prefix}_{secrets.token_hex(24)}"
        out.append(record)
    return out


def _parts(content: str | list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        return [{"type": kind, "text": content}]
    return content


def record(response: dict[str, Any], inputs: list[dict[str, Any]],
           instructions: str | None) -> dict[str, Any]:
    """The ``meta`` a stored response's session keeps."""
    return {"response": response, "input_items": inputs, "instructions": instructions}


def page(items: list[dict[str, Any]], order: str, limit: int, after: str | None
         ) -> dict[str, Any]:
    """A list page of input items, as OpenAI's cursor lists are."""
    ordered = items if order == "asc" else list(reversed(items))
    if after:
        ids = [i["id"] for i in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
