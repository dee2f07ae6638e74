"""``POST /v1/completions`` and ``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server import metrics
from server.auth import Owner
from server.chat_template import CHAT_STOP, render_chat
from server.client import RequestHandle
from server.formatting import (
    SSE_HEADERS,
    CompletionLogprobs,
    StripStream,
    chat_logprobs,
    finish_reason,
    usage,
)
from server.protocol import ChatRequest, CompletionRequest, now
from server.routes.docs import ERRORS, SSE_RESPONSE
from server.service import GenerationService, Prepared
from server.streaming import event_stream, log_request, observe_tokens
from server.types import Output

router = APIRouter(tags=["completions"])
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256
DISCONNECT_POLL_SECONDS = 0.25


def _service(request: Request) -> GenerationService:
    svc: GenerationService = request.app.state.service
    return svc


def _prepare(svc: GenerationService, body: CompletionRequest | ChatRequest, owner: str,
             prompt_ids: list[int], default_max: int, logprobs: int | None,
             stop: tuple[str, ...]) -> Prepared:
    default_max = min(default_max, svc.settings.max_tokens_limit)
    max_tokens = svc.check_max_tokens(body.requested_max_tokens() or default_max)
    params = body.to_sampling_params(max_tokens, logprobs)
    svc.check_stop_ids(params)
    echo_lp = isinstance(body, CompletionRequest) and body.echo and logprobs is not None
    fault = None
    if svc.settings.fault_injection and body.model_extra:
        fault = body.model_extra.get("linserve_fault")
    return Prepared(prompt_ids, params, stop, owner, body.session_id, prompt_logprobs=echo_lp,
                    chat=isinstance(body, ChatRequest), fault=fault)


@router.post("/v1/completions", responses={**ERRORS, 200: SSE_RESPONSE})
async def completions(body: CompletionRequest, request: Request, owner: Owner) -> Any:
    """OpenAI text completions, streaming (SSE) or not; ``session_id`` continues a session."""
    svc = _service(request)
    prompt_ids = svc.tokenize_prompt(body.prompt)
    prep = _prepare(svc, body, owner, prompt_ids, DEFAULT_COMPLETION_TOKENS, body.logprobs,
                    body.stop_list())
    handle = await svc.start(prep)
    name = request.app.state.model_name
    echo = svc.tok.decode(prompt_ids) if body.echo else ""
    lp = (CompletionLogprobs(svc.tok, as_ids=body.return_tokens_as_token_ids)
          if body.logprobs is not None else None)

    def choice(out: Output, text: str) -> dict[str, Any]:
        logprobs = None
        if lp is not None:
            entries = (out.prompt_logprobs or []) + out.logprobs
            logprobs = lp.piece(entries)
        return {"index": 0, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason(out)}

    base = {"id": handle.req.request_id, "object": "text_completion", "created": now(),
            "model": name}
    if body.session_id:
        base["session_id"] = body.session_id
    if not body.stream:
        out = await _collect(svc, handle, request)
        lp_total = None
        if lp is not None:
            lp.piece((out.prompt_logprobs or []) + out.logprobs)
            lp_total = lp.data
        return JSONResponse({**base, "choices": [{"index": 0, "text": echo + out.text,
                                                  "logprobs": lp_total,
                                                  "finish_reason": finish_reason(out)}],
                             "usage": usage(out)})
    state = {"first": True}

    def render(out: Output) -> dict[str, Any] | None:
        text = out.text
        if state["first"]:
            text, state["first"] = echo + text, False
        if not text and not out.token_ids and out.finish_reason is None:
            return None
        return {**base, "choices": [choice(out, text)], "usage": None}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_chunk = (lambda out: {**base, "choices": [], "usage": usage(out)}) \
        if include_usage else None
    return _stream(handle, render, usage_chunk, request)


async def _collect(svc: GenerationService, handle: RequestHandle, request: Request) -> Output:
    """The whole result of a non-streaming request, with its metrics and log line. A client
    that disconnects first has its request cancelled (the session is left unchanged: the
    client received nothing)."""
    task = asyncio.ensure_future(svc.collect(handle))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                break
            if await request.is_disconnected():
                metrics.DISCONNECTS.inc()
                handle.cancel()
                await asyncio.wait({task})
                break
    except asyncio.CancelledError:
        handle.cancel()
        raise
    out = task.result()
    observe_tokens(handle, out)
    log_request(handle, out, "ok" if out.finish_reason != "cancelled" else "disconnected")
    return out


def _stream(handle: RequestHandle, render: Any, usage_chunk: Any,
            request: Request) -> StreamingResponse:
    keepalive = request.app.state.settings.keepalive_seconds
    return StreamingResponse(event_stream(handle, render, usage_chunk, keepalive),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/chat/completions", responses={**ERRORS, 200: SSE_RESPONSE})
async def chat_completions(body: ChatRequest, request: Request, owner: Owner) -> Any:
    """OpenAI chat completions over the plain-text chat template (see ``chat_template``)."""
    svc = _service(request)
    prompt_ids = svc.tokenize_prompt(render_chat(body.messages), "messages")
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    prep = _prepare(svc, body, owner, prompt_ids, DEFAULT_CHAT_TOKENS, n_lp,
                    body.stop_list() + CHAT_STOP)
    handle = await svc.start(prep)
    base = {"id": handle.req.request_id.replace("cmpl", "chatcmpl", 1), "created": now(),
            "model": request.app.state.model_name}
    if body.session_id:
        base["session_id"] = body.session_id
    if not body.stream:
        out = await _collect(svc, handle, request)
        message = {"role": "assistant", "content": out.text.strip()}
        return JSONResponse({**base, "object": "chat.completion", "choices": [{
            "index": 0, "message": message, "finish_reason": finish_reason(out),
            "logprobs": chat_logprobs(svc.tok, out.logprobs) if n_lp is not None else None}],
            "usage": usage(out)})
    state = {"first": True}
    trim = StripStream()

    def render(out: Output) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if state["first"]:
            delta["role"], state["first"] = "assistant", False
        text = trim.feed(out.text)
        if text:
            delta["content"] = text
        if not delta and out.finish_reason is None:
            return None
        lp = chat_logprobs(svc.tok, out.logprobs) if n_lp is not None else None
        return {**base, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": delta, "logprobs": lp,
            "finish_reason": finish_reason(out)}], "usage": None}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_chunk = (lambda out: {**base, "object": "chat.completion.chunk", "choices": [],
                                "usage": usage(out)}) if include_usage else None
    return _stream(handle, render, usage_chunk, request)
