"""Server-sent events for a running request: chunks, keep-alives, usage, ``[DONE]``, and
cancellation (with the count of tokens actually sent) when the client goes away."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from server import metrics
from server.client import RequestHandle
from server.errors import error_body
from server.formatting import SSE_DONE, SSE_KEEPALIVE, sse
from server.service import STORE_FAILED, engine_error
from server.types import Output

log = logging.getLogger("linserve.request")
Render = Callable[[Output], dict[str, Any] | None]


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


async def event_stream(handle: RequestHandle, render: Render, usage_chunk: Render | None,
                       keepalive: float) -> AsyncIterator[str]:
    """Yield SSE frames until the request finishes; cancel it if the client disconnects."""
    final: Output | None = None
    try:
        while True:
            out = await handle.next(timeout=keepalive)
            if out is None:
                yield SSE_KEEPALIVE
                continue
            if out.error is not None:
                err = engine_error(out)
                yield sse(error_body(err.status, err.message, None, err.code))
                final = out
                break
            observe_tokens(handle, out)
            chunk = render(out)
            if chunk is not None:
                yield sse(chunk)
            handle.sent_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                final = out
                if handle.saved is not None and not await handle.saved:
                    yield sse(error_body(503, STORE_FAILED, "session_id",
                                         "session_store_failed"))
                    break
                if usage_chunk is not None:
                    extra = usage_chunk(out)
                    if extra is not None:
                        yield sse(extra)
                break
        yield SSE_DONE
    finally:
        if final is None:
            metrics.DISCONNECTS.inc()
            handle.cancel()
        log_request(handle, final, "ok" if final and final.error is None else "disconnected")
