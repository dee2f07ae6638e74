"""``POST /v1/completions`` and ``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from linserve.server.api.auth import Owner
from linserve.server.api.chat_reply import ChatDeltas
from linserve.server.api.chat_run import collect_reply, prepare, start_chat
from linserve.server.api.formatting import (
    SSE_DONE,
    SSE_HEADERS,
    CompletionLogprobs,
    chat_logprobs,
    finish_reason,
    sse,
    usage_of,
)
from linserve.server.api.protocol import ChatRequest, CompletionRequest, now
from linserve.server.api.routes.docs import ERRORS, SSE_RESPONSE
from linserve.server.api.service import GenerationService
from linserve.server.api.streaming import event_stream
from linserve.server.engine.client import RequestHandle
from linserve.server.engine.types import Output

router = APIRouter(tags=["completions"])
DEFAULT_COMPLETION_TOKENS = 16



def _service(request: Request) -> GenerationService:
    svc: GenerationService = request.app.state.service
    return svc


@router.post("/v1/completions", responses={**ERRORS, 200: SSE_RESPONSE})
async def completions(body: CompletionRequest, request: Request, owner: Owner) -> Any:
    """OpenAI text completions, streaming (SSE) or not; ``session_id`` continues a session.
    A batch of prompts and ``n`` give choice ``i·n + j`` for sample j of prompt i."""
    svc = _service(request)
    k = max(body.n, body.best_of or body.n)  # samples per prompt (best_of keeps the top n)
    run_lp = body.logprobs if body.logprobs is not None or k == body.n else 0
    all_ids = [svc.tokenize_prompt(p) for p in body.prompts()]
    handles = await _start_all(svc, body, owner, all_ids, k, run_lp)
    prompt_of = [i for i, _ in enumerate(all_ids) for _ in range(k)]
    echoes = [svc.tok.decode(ids) if body.echo else "" for ids in all_ids]
    lps = [CompletionLogprobs(svc.tok, as_ids=body.return_tokens_as_token_ids)
           if body.logprobs is not None else None for _ in handles]
    base = {"id": handles[0].req.request_id, "object": "text_completion", "created": now(),
            "model": request.app.state.model_name}
    if body.session_id:
        base["session_id"] = body.session_id
    prompt_tokens = sum(len(ids) for ids in all_ids)

    def usage(outs: list[Output]) -> dict[str, Any]:
        return usage_of(outs, prompt_tokens, cached_of(handles, outs))

    def choice(j: int, out: Output, text: str, whole: bool = False) -> dict[str, Any]:
        logprobs = None
        lp = lps[j]
        if lp is not None:
            part = lp.piece((out.prompt_logprobs or []) + out.logprobs)
            logprobs = lp.data if whole else part
        return {"index": j, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason(out)}

    if k > body.n:  # best_of: every sample runs to its end, the top n are returned
        outs = await asyncio.gather(*(collect_reply(svc, h, request) for h in handles))
        kept = best_of(outs, k, body.n)
        choices = [choice(j, outs[i], echoes[prompt_of[i]] + outs[i].text, whole=True)
                   for j, i in enumerate(kept)]
        return _whole(body, base, choices, usage(outs))
    if not body.stream:
        outs = await asyncio.gather(*(collect_reply(svc, h, request) for h in handles))
        return JSONResponse({**base, "choices": [
            choice(i, out, echoes[prompt_of[i]] + out.text, whole=True)
            for i, out in enumerate(outs)], "usage": usage(outs)})
    started: set[int] = set()

    def render(i: int, out: Output) -> dict[str, Any] | None:
        text = out.text
        if i not in started:
            text = echoes[prompt_of[i]] + text
            started.add(i)
        if not text and not out.token_ids and out.finish_reason is None:
            return None
        return {**base, "choices": [choice(i, out, text)], "usage": None}

    usage_chunk = None
    if body.stream_options and body.stream_options.include_usage:
        def usage_chunk(outs: list[Output]) -> dict[str, Any]:
            return {**base, "choices": [], "usage": usage(outs)}
    return _stream(handles, render, usage_chunk, request)


def _whole(body: CompletionRequest, base: dict[str, Any], choices: list[dict[str, Any]],
           usage: dict[str, Any]) -> Response:
    """A finished result (``best_of``): one JSON body, or for a stream one chunk per choice,
    the usage chunk if asked, and ``[DONE]``."""
    if not body.stream:
        return JSONResponse({**base, "choices": choices, "usage": usage})
    frames = [sse({**base, "choices": [c], "usage": None}) for c in choices]
    if body.stream_options and body.stream_options.include_usage:
        frames.append(sse({**base, "choices": [], "usage": usage}))
    frames.append(SSE_DONE)
    return StreamingResponse(iter(frames), media_type="text/event-stream", headers=SSE_HEADERS)


async def _start_all(svc: GenerationService, body: CompletionRequest, owner: str,
                     all_ids: list[list[int]], k: int, logprobs: int | None
                     ) -> list[RequestHandle]:
    """``k`` samples of every prompt, in choice order; all cancelled if one cannot start."""
    grammar = await svc.grammar_of(body)
    handles: list[RequestHandle] = []
    try:
        for ids in all_ids:
            prep = prepare(svc, body, owner, ids, DEFAULT_COMPLETION_TOKENS, logprobs,
                            body.stop_list(), grammar)
            handles += await svc.start_choices(prep, k)
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


def cached_of(handles: list[RequestHandle], outs: list[Output]) -> int:
    """Prompt tokens the prefix cache served: per prompt, its shared prefill's hit (n > 1)
    or its one request's (n = 1)."""
    forked = {id(h.req.start_blob): h.forked_from for h in handles if h.forked_from is not None}
    alone = sum(o.cached_tokens for h, o in zip(handles, outs, strict=True)
                if h.forked_from is None)
    return alone + sum(v for v in forked.values() if v is not None)


def best_of(outs: list[Output], k: int, n: int) -> list[int]:
    """Indices of the kept samples: for each prompt's ``k`` samples (consecutive in
    ``outs``), the ``n`` with the highest total log-probability, best first (OpenAI's
    ``best_of``)."""
    kept: list[int] = []
    for start in range(0, len(outs), k):
        group = range(start, start + k)
        score = {i: sum(e.logprob or 0.0 for e in outs[i].logprobs) for i in group}
        kept += sorted(group, key=lambda i: -score[i])[:n]
    return kept


def _stream(handles: list[RequestHandle], render: Any, usage_chunk: Any,
            request: Request) -> StreamingResponse:
    keepalive = request.app.state.settings.keepalive_seconds
    return StreamingResponse(event_stream(handles, render, usage_chunk, keepalive),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/chat/completions", responses={**ERRORS, 200: SSE_RESPONSE})
async def chat_completions(body: ChatRequest, request: Request, owner: Owner) -> Any:
    """OpenAI chat completions: the checkpoint's own chat template where it has one, else
    the plain-text one of the project's base models (see ``chat_template``); tool calls and
    reasoning as the request and ``--tool-call-parser`` / ``--reasoning-parser`` ask
    (``chat_reply``)."""
    svc = _service(request)
    run = await start_chat(svc, body, owner)
    handles, shape, prompt_ids = run.handles, run.shape, run.prompt_ids
    n_lp = (body.top_logprobs or 0) if body.logprobs else None
    base = {"id": handles[0].req.request_id.replace("cmpl", "chatcmpl", 1), "created": now(),
            "model": request.app.state.model_name}
    if body.session_id:
        base["session_id"] = body.session_id

    def usage(outs: list[Output]) -> dict[str, Any]:
        return usage_of(outs, len(prompt_ids), cached_of(handles, outs))

    def logprobs(out: Output) -> dict[str, Any] | None:
        return chat_logprobs(svc.tok, out.logprobs) if n_lp is not None else None

    def finish(out: Output, called: bool) -> str | None:
        reason = finish_reason(out)
        return "tool_calls" if called and reason == "stop" else reason

    if not body.stream:
        outs = await asyncio.gather(*(collect_reply(svc, h, request) for h in handles))
        choices = []
        for k, out in enumerate(outs):
            message, called = shape.message(out.text)
            choices.append({"index": k, "message": message, "logprobs": logprobs(out),
                            "finish_reason": finish(out, called)})
        return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                             "usage": usage(outs)})
    started: set[int] = set()
    streams = [ChatDeltas(shape) for _ in handles]

    def chunk(k: int, delta: dict[str, Any], out: Output | None, reason: str | None
              ) -> dict[str, Any]:
        return {**base, "object": "chat.completion.chunk", "choices": [{
            "index": k, "delta": delta, "logprobs": logprobs(out) if out else None,
            "finish_reason": reason}], "usage": None}

    def render(k: int, out: Output) -> list[dict[str, Any]]:
        deltas = streams[k].feed(out.text)
        if out.finish_reason is not None:
            deltas += streams[k].finish()
        if k not in started:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {})}, *deltas[1:]]
            started.add(k)
        if not deltas and out.finish_reason is None:
            return []
        last = finish(out, streams[k].calls > 0) if out.finish_reason is not None else None
        if not deltas:
            deltas = [{}]
        return [chunk(k, d, out if i == 0 else None, last if i == len(deltas) - 1 else None)
                for i, d in enumerate(deltas)]

    usage_chunk = None
    if body.stream_options and body.stream_options.include_usage:
        def usage_chunk(outs: list[Output]) -> dict[str, Any]:
            return {**base, "object": "chat.completion.chunk", "choices": [],
                    "usage": usage(outs)}
    return _stream(handles, render, usage_chunk, request)
