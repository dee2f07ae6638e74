"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``, in Anthropic's formats and error envelope (the anthropic
SDK and Claude Code pointed at this server).

A request becomes a chat request (:mod:`linserve.server.api.messages.convert`) and runs through the
chat path, with the checkpoint's template, tool-call and reasoning parsers.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from linserve.server.api.auth import Owner
from linserve.server.api.chat_reply import ChatDeltas
from linserve.server.api.chat_run import collect_reply, count_prompt, start_chat
from linserve.server.api.errors import APIError, anthropic_body
from linserve.server.api.formatting import SSE_HEADERS
from linserve.server.api.messages.convert import (
    content_blocks,
    new_message_id,
    stop_of,
    to_chat,
    usage,
)
from linserve.server.api.messages.events import MessageEvents
from linserve.server.api.messages.protocol import CountTokensRequest, MessagesRequest
from linserve.server.api.routes.docs import ANTHROPIC_ERRORS, SSE_RESPONSE
from linserve.server.api.service import GenerationService
from linserve.server.api.streaming import Framing, event_stream, named_event

router = APIRouter(tags=["anthropic"])


def _error(err: APIError) -> dict[str, Any]:
    return anthropic_body(err.status, err.message)


MESSAGES_STREAM = Framing(frame=named_event, keepalive=named_event({"type": "ping"}), done="",
                          error=_error)


def _svc(request: Request) -> GenerationService:
    svc: GenerationService = request.app.state.service
    return svc


@router.post("/v1/messages", responses={**ANTHROPIC_ERRORS, 200: SSE_RESPONSE})
async def create_message(body: MessagesRequest, request: Request, owner: Owner) -> Any:
    """Anthropic's Messages API: content blocks (thinking, text, tool_use), ``stop_reason``
    and usage, whole or as its streamed events."""
    svc = _svc(request)
    mid = new_message_id()
    run = await start_chat(svc, to_chat(body), owner,
                           call_ids=f"toolu_{mid.removeprefix('msg_')}_")
    handle, prompt_tokens = run.handles[0], len(run.prompt_ids)
    model = body.model
    if not body.stream:
        out = await collect_reply(svc, handle, request)
        message, called = run.shape.message(handle.text)
        reason, sequence = stop_of(out, body, called)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant",
                             "model": model, "content": content_blocks(message),
                             "stop_reason": reason, "stop_sequence": sequence,
                             "usage": usage(prompt_tokens, out)})
    events = MessageEvents(mid, model, body, ChatDeltas(run.shape), prompt_tokens)
    keepalive = request.app.state.settings.keepalive_seconds
    return StreamingResponse(
        event_stream(run.handles, lambda _, out: events.feed(out), None, keepalive,
                     MESSAGES_STREAM, events.opening()),
        media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/messages/count_tokens", responses=ANTHROPIC_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request, owner: Owner) -> Any:
    """The prompt tokens a Messages request with these messages, system, tools and
    thinking would have (rendered by the same template)."""
    svc = _svc(request)
    chat = to_chat(body.as_request())
    return {"input_tokens": await count_prompt(svc, chat, owner)}
