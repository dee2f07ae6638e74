"""Sessions: create, read, delete, fork, export and import. Each is owned by the API key
that made it; any other key gets 404. Also the named initial states (``--state-dir``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Request, Response

from linserve.model.info import StateError
from linserve.server.api.auth import Owner
from linserve.server.api.chat_session import Transcript
from linserve.server.api.errors import APIError
from linserve.server.api.protocol import SessionCreate, SessionInfo
from linserve.server.api.routes.docs import ERRORS
from linserve.server.api.service import GenerationService
from linserve.server.engine.client import EngineUnavailable
from linserve.server.sessions.store import (
    Session,
    SessionUnavailable,
    new_session_id,
    session_problem,
)

router = APIRouter(tags=["sessions"])
T = TypeVar("T")


def _svc(request: Request) -> GenerationService:
    svc: GenerationService = request.app.state.service
    return svc


def _info(sess: Session, model: str, busy: bool = False) -> SessionInfo:
    return SessionInfo(id=sess.id, tokens=sess.tokens, state_bytes=sess.state_bytes,
                       model=model, created=int(sess.created), last_used=int(sess.last_used),
                       busy=busy)


async def _get(svc: GenerationService, sid: str, owner: str) -> Session:
    try:
        sess = await svc.store.get(sid, owner)
    except SessionUnavailable as exc:
        raise APIError(503, "session store unavailable", "session_id") from exc
    if sess is None:
        raise APIError(404, f"session {sid!r} not found", "session_id")
    return sess


async def engine_call(call: Awaitable[T]) -> T:
    """An engine call's result (a state read or written by the model): 503 while the engine
    is down, 500 if it failed; its StateError passes (the caller's 400)."""
    try:
        return await call
    except EngineUnavailable as exc:
        raise APIError(503, f"the engine is unavailable ({exc}); retry shortly", None,
                       "engine_unavailable") from exc
    except RuntimeError as exc:
        raise APIError(500, f"the engine could not read the state: {exc}", None,
                       "internal_error") from exc


@router.get("/v1/states", responses=ERRORS)
async def list_states(request: Request, owner: Owner) -> dict[str, Any]:
    """The named initial states (``--state-dir``) a request may start from with
    ``"state": NAME``: each file's name and digest."""
    del owner
    held = _svc(request).named_states.values()
    return {"object": "list", "data": [{"id": s.name, "object": "state", "digest": s.digest}
                                       for s in held]}


@router.post("/v1/sessions", response_model=SessionInfo, responses=ERRORS)
async def create_session(request: Request, owner: Owner,
                         body: SessionCreate | None = None) -> SessionInfo:
    """Create a session, prefilling ``prompt`` (text or token ids) if given, from the named
    initial ``state`` if given (``--state-dir``)."""
    svc = _svc(request)
    ids = svc.tokenize_prompt(body.prompt if body else "")
    sess = await svc.create_session(owner, ids, body.state if body else None)
    return _info(sess, request.app.state.model_name)


@router.get("/v1/sessions/{session_id}", response_model=SessionInfo, responses=ERRORS)
async def get_session(session_id: str, request: Request, owner: Owner) -> SessionInfo:
    try:
        sess, busy = await _svc(request).store.status(session_id, owner)
    except SessionUnavailable as exc:
        raise APIError(503, "session store unavailable", "session_id") from exc
    if sess is None:
        raise APIError(404, f"session {session_id!r} not found", "session_id")
    return _info(sess, request.app.state.model_name, busy)


@router.delete("/v1/sessions/{session_id}", responses=ERRORS)
async def delete_session(session_id: str, request: Request, owner: Owner) -> dict[str, object]:
    """Delete a session: 409 while a request is running on it (cancel that request first),
    so an in-flight save can never bring a deleted session back."""
    await _svc(request).delete_session(session_id, owner)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/v1/sessions/{session_id}/fork", response_model=SessionInfo, responses=ERRORS)
async def fork_session(session_id: str, request: Request, owner: Owner) -> SessionInfo:
    """A new, independent session starting from a copy of this one's state."""
    svc = _svc(request)
    src = await _get(svc, session_id, owner)
    # Stored states are never mutated in place (the engine copies before advancing), so
    # sharing the tensors is an exact, free copy.
    fork = Session(new_session_id(), owner, src.state, list(src.pending), src.tokens,
                   chat=src.chat)
    fork = await svc.put_new(fork)
    return _info(fork, request.app.state.model_name)


@router.get("/v1/sessions/{session_id}/state", responses={
    **ERRORS, 200: {"content": {"application/octet-stream": {}},
                    "description": "The state as safetensors bytes"}})
async def export_session(session_id: str, request: Request, owner: Owner,
                         format: Literal["safetensors", "pth"] = "safetensors") -> Response:
    """The session's state: this server's blob (``safetensors``, which imports back with
    its tokens and transcript), or the model's own state file (``pth``: RWKV's
    ``blocks.N.att.time_state``, as RWKV-Runner and ai00 load them)."""
    svc = _svc(request)
    sess = await _get(svc, session_id, owner)
    extra: dict[str, Any] = {"tokens": sess.tokens, "pending": sess.pending}
    if sess.chat is not None:
        extra["chat"] = sess.chat
    try:
        blob = (await engine_call(svc.client.state_file(sess.state, extra)) if format == "pth"
                else sess.state.with_extra(extra).data)
    except StateError as exc:
        raise APIError(400, str(exc), "format", "unsupported_format") from exc
    disposition = f'attachment; filename="{sess.id}.{format}"'
    return Response(blob, media_type="application/octet-stream",
                    headers={"Content-Disposition": disposition})


@router.post("/v1/sessions/import", response_model=SessionInfo, responses=ERRORS,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string",
                                                         "format": "binary"}}}}})
async def import_session(request: Request, owner: Owner) -> SessionInfo:
    """Create a session from bytes made by ``GET /v1/sessions/{id}/state``."""
    svc = _svc(request)
    data = await request.body()
    try:
        state, extra = await engine_call(svc.client.import_state(data))
    except StateError as exc:
        raise APIError(400, f"invalid state: {exc}", "body", "invalid_state") from exc
    pending, tokens = extra.get("pending", []), extra.get("tokens", 0)
    problem = session_problem(state, tokens, pending, svc.info)
    chat = extra.get("chat")
    if problem is None and chat is not None and Transcript.from_json(chat) is None:
        problem = "'chat' is not a chat transcript (messages and text)"
    if problem is not None:
        raise APIError(400, f"invalid state: {problem}", "body", "invalid_state")
    sess = Session(new_session_id(), owner, state, pending, tokens, time.time(), time.time(),
                   chat=chat)
    sess = await svc.put_new(sess)
    return _info(sess, request.app.state.model_name)
