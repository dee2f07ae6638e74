"""Server-sent events for a running request: chunks, keep-alives, usage, ``[DONE]``, and
cancellation (with the count of tokens actually sent) when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from linserve.server import metrics
from linserve.server.api.errors import APIError, error_body
from linserve.server.api.formatting import SSE_DONE, SSE_KEEPALIVE, sse
from linserve.server.api.service import STORE_FAILED, engine_error
from linserve.server.engine.client import RequestHandle
from linserve.server.engine.types import Output

log = logging.getLogger("linserve.request")


def observe_tokens(handle: RequestHandle, out: Output) -> None:
    """Client-side latency metrics for a delta that is about to be sent."""
    if not out.token_ids:
        return
    now = time.monotonic()
    if handle.first_token is None:
        handle.first_token = now
        metrics.TTFT.observe(now - handle.started)
    elif handle.last_token is not None:
        metrics.ITL.observe((now - handle.last_token) / len(out.token_ids))
    handle.last_token = now


def log_request(handle: RequestHandle, final: Output | None, status: str) -> None:
    """One structured line per request."""
    now = time.monotonic()
    metrics.E2E.observe(now - handle.started)
    record = {"event": "request", "id": handle.req.request_id, "status": status,
              "prompt_tokens": len(handle.req.input_ids),
              "output_tokens": final.completion_tokens if final else handle.sent_tokens,
              "ttft_ms": round((handle.first_token - handle.started) * 1000, 1)
              if handle.first_token else None,
              "duration_ms": round((now - handle.started) * 1000, 1),
              "finish_reason": final.finish_reason if final else None}
    log.info(json.dumps(record))


Render = Callable[[int, Output], dict[str, Any] | list[dict[str, Any]] | None]
UsageRender = Callable[[list[Output]], dict[str, Any] | list[dict[str, Any]] | None]


def openai_error(err: APIError) -> dict[str, Any]:
    return error_body(err.status, err.message, err.param, err.code)


def named_event(data: dict[str, Any]) -> str:
    """An SSE frame named by the event's ``type`` (the Responses and Anthropic streams)."""
    return f"event: {data['type']}\ndata: {orjson.dumps(data).decode()}\n\n"


@dataclass(frozen=True)
class Framing:
    """How a stream is written: by default OpenAI's ``data:`` frames, comment keep-alives
    and a closing ``[DONE]``; the Responses and Anthropic APIs name their events."""

    frame: Callable[[dict[str, Any]], str] = sse
    keepalive: str = SSE_KEEPALIVE
    done: str = SSE_DONE
    error: Callable[[APIError], dict[str, Any] | list[dict[str, Any]]] = openai_error


OPENAI = Framing()


async def _fan_in(handles: list[RequestHandle], keepalive: float
                  ) -> AsyncIterator[tuple[int, Output] | None]:
    """Deltas of every handle as they come, tagged with the handle's index (choices
    interleave, as OpenAI streams ``n`` > 1); None when ``keepalive`` passes quietly."""
    if len(handles) == 1:
        while True:
            out = await handles[0].next(timeout=keepalive)
            yield None if out is None else (0, out)
        return
    merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()

    async def pump(k: int, handle: RequestHandle) -> None:
        while True:
            out = await handle.next()
            assert out is not None
            await merged.put((k, out))
            if out.finish_reason is not None or out.error is not None:
                return

    tasks = [asyncio.create_task(pump(k, h)) for k, h in enumerate(handles)]
    try:
        while True:
            try:
                yield await asyncio.wait_for(merged.get(), keepalive)
            except TimeoutError:
                yield None
    finally:
        for task in tasks:
            task.cancel()


def _frames(framing: Framing, chunks: dict[str, Any] | list[dict[str, Any]] | None
            ) -> str:
    return "".join(framing.frame(c) for c in (chunks if isinstance(chunks, list) else [chunks])
                   if c is not None)


async def event_stream(handles: list[RequestHandle], render: Render,
                       usage_chunk: UsageRender | None, keepalive: float,
                       framing: Framing = OPENAI, opening: Sequence[dict[str, Any]] = ()
                       ) -> AsyncIterator[str]:
    """Yield SSE frames (``opening`` first) until every choice finishes, then what
    ``usage_chunk`` makes of the last outputs; cancel all if the client disconnects (each
    session or request keeps exactly the tokens it sent)."""
    finals: dict[int, Output] = {}
    failed = False
    try:
        if opening:
            yield _frames(framing, list(opening))
        async for item in _fan_in(handles, keepalive):
            if item is None:
                yield framing.keepalive
                continue
            k, out = item
            handle = handles[k]
            if out.error is not None:
                yield _frames(framing, framing.error(engine_error(out)))
                finals[k], failed = out, True
                break
            observe_tokens(handle, out)
            frames = _frames(framing, render(k, out))
            if out.finish_reason is not None:
                finals[k] = out
                if handle.saved is not None and not await handle.saved:
                    yield frames + _frames(framing, framing.error(APIError(
                        503, STORE_FAILED, "session_id", "session_store_failed")))
                    failed = True
                    break
            if frames:
                yield frames
            handle.sent_tokens += len(out.token_ids)
            if len(finals) == len(handles):
                break
        if not failed and usage_chunk is not None and len(finals) == len(handles):
            yield _frames(framing, usage_chunk([finals[k] for k in range(len(handles))]))
        if framing.done:
            yield framing.done
    finally:
        for k, handle in enumerate(handles):
            final = finals.get(k)
            if final is None:
                if not failed:
                    metrics.DISCONNECTS.inc()
                handle.cancel()
            log_request(handle, final, "ok" if final and final.error is None
                        else "disconnected")
