"""The OpenAI Responses API: ``POST /v1/responses`` (whole or streamed), and the stored
responses' ``GET``, ``DELETE`` and ``GET …/input_items``.

A request becomes a chat request (:mod:`linserve.server.api.responses.items`) and runs through the
chat path. With ``store`` (the default) or ``previous_response_id`` it runs in a session
named by the response id (:mod:`linserve.server.api.responses.stored`): a new conversation starts
from the empty state, a continuation from a fork of the stored one, so only the new input
is prefilled.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from linserve.server.api.auth import Owner
from linserve.server.api.chat_reply import ChatDeltas
from linserve.server.api.chat_run import ChatRun, collect_reply, start_chat
from linserve.server.api.errors import APIError
from linserve.server.api.formatting import SSE_HEADERS
from linserve.server.api.protocol import ChatMessage
from linserve.server.api.responses import stored
from linserve.server.api.responses.events import ResponseEvents
from linserve.server.api.responses.items import ResponseBuilder, to_chat, to_messages
from linserve.server.api.responses.protocol import ResponsesRequest
from linserve.server.api.routes.docs import ERRORS, SSE_RESPONSE
from linserve.server.api.service import GenerationService
from linserve.server.api.streaming import Framing, event_stream, named_event
from linserve.server.sessions.store import Session, SessionUnavailable

router = APIRouter(tags=["responses"])


def _svc(request: Request) -> GenerationService:
    svc: GenerationService = request.app.state.service
    return svc


async def _conversation(svc: GenerationService, body: ResponsesRequest, owner: str
                        ) -> tuple[Session | None, list[ChatMessage], str | None]:
    """The stored response continued (if any), the new messages, and the conversation's
    instructions (a stored conversation keeps those it started with)."""
    messages = to_messages(body.items())
    if body.previous_response_id is None:
        if body.instructions:
            messages.insert(0, ChatMessage.model_validate(
                {"role": "system", "content": body.instructions}))
        return None, messages, body.instructions
    prev = await stored.load(svc, body.previous_response_id, owner, "previous_response_id")
    assert prev.meta is not None
    kept = prev.meta.get("instructions")
    if body.instructions is not None and body.instructions != kept:
        raise APIError(400, "instructions differ from those the stored conversation started "
                       "with (its state holds them); send the same ones or none",
                       "instructions", "invalid_value")
    if prev.meta["response"].get("status") == "in_progress":
        raise APIError(409, f"response {body.previous_response_id!r} is still in progress",
                       "previous_response_id", "response_in_progress")
    return prev, messages, kept


async def _open_session(svc: GenerationService, rid: str, owner: str, prev: Session | None,
                        meta: dict[str, Any]) -> Session:
    """The session the request runs in: a fork of the stored response, or a new one."""
    if prev is not None:
        sess = Session(rid, owner, prev.state, list(prev.pending), prev.tokens,
                       chat=prev.chat, meta=meta)
    else:
        state, pending = await svc.build_state([])
        sess = Session(rid, owner, state, pending, 0, meta=meta)
    return await svc.put_new(sess)


@router.post("/v1/responses", responses={**ERRORS, 200: SSE_RESPONSE})
async def create_response(body: ResponsesRequest, request: Request, owner: Owner) -> Any:
    """Create a model response: whole, or streamed as the Responses events. ``store``
    keeps it (and its state) for ``previous_response_id``, which continues it."""
    svc = _svc(request)
    rid = stored.new_response_id()
    prev, messages, instructions = await _conversation(svc, body, owner)
    builder = ResponseBuilder(rid, body, request.app.state.model_name, tok=svc.tok)
    inputs = stored.input_records(body.items())
    session_id = None
    if body.store or prev is not None:
        meta = stored.record(builder.skeleton(), inputs, instructions)
        await _open_session(svc, rid, owner, prev, meta)
        session_id = rid
        if prev is not None:
            builder.prior_tokens = prev.tokens
            builder.reused_tokens = prev.tokens - len(prev.pending)
    try:
        run = await start_chat(
            svc, to_chat(body, messages, session_id), owner,
            meta=lambda text, out: stored.record(builder.finished(text, out), inputs,
                                                 instructions),
            call_ids=f"call_{rid.removeprefix('resp_')[:24]}_")
    except BaseException:
        if session_id is not None:
            await _forget(svc, rid, owner)
        raise
    builder.shape, builder.prompt_tokens = run.shape, len(run.prompt_ids)
    if session_id is not None and not body.store:
        svc.spawn(_forget_after(svc, run, rid, owner))
    if not body.stream:
        out = await collect_reply(svc, run.handles[0], request)
        return JSONResponse(builder.finished(run.handles[0].text, out))
    return _stream(run, builder, request)


def _stream(run: ChatRun, builder: ResponseBuilder, request: Request) -> StreamingResponse:
    events = ResponseEvents(builder, ChatDeltas(run.shape))
    keepalive = request.app.state.settings.keepalive_seconds
    framing = Framing(frame=named_event, done="", error=events.failed)
    return StreamingResponse(
        event_stream(run.handles, lambda _, out: events.feed(out), None, keepalive,
                     framing, events.opening()),
        media_type="text/event-stream", headers=SSE_HEADERS)


async def _forget(svc: GenerationService, rid: str, owner: str) -> None:
    with contextlib.suppress(SessionUnavailable):
        await svc.store.delete(rid, owner)


async def _forget_after(svc: GenerationService, run: ChatRun, rid: str, owner: str) -> None:
    """A ``store: false`` continuation ran in a session of its own: drop it once saved."""
    saved = run.handles[0].saved
    if saved is not None:
        await asyncio.shield(saved)
    await _forget(svc, rid, owner)


@router.get("/v1/responses/{response_id}", responses=ERRORS)
async def get_response(response_id: str, request: Request, owner: Owner) -> Any:
    """A stored response (``status`` in_progress while its reply runs)."""
    sess = await stored.load(_svc(request), response_id, owner)
    assert sess.meta is not None
    return JSONResponse(sess.meta["response"])


@router.delete("/v1/responses/{response_id}", responses=ERRORS)
async def delete_response(response_id: str, request: Request, owner: Owner) -> Any:
    """Delete a stored response and its state (409 while its reply still runs)."""
    svc = _svc(request)
    await stored.load(svc, response_id, owner)
    await svc.delete_session(response_id, owner, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", responses=ERRORS)
async def list_input_items(response_id: str, request: Request, owner: Owner,
                           order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100),
                           after: str | None = None) -> Any:
    """The input items of a stored response (this request's own, not the earlier turns'),
    newest first by default."""
    sess = await stored.load(_svc(request), response_id, owner)
    assert sess.meta is not None
    return stored.page(sess.meta["input_items"], order, limit, after)
