"""What the HTTP side holds of an engine, torch-free: the interface both kinds implement
(:class:`EngineBackend`: a process, :mod:`.process`, or a thread, :mod:`.thread_client`),
its health, and a submitted request's handle, whose deltas arrive on an asyncio queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from linserve.server import metrics
from linserve.server.engine.description import EngineCalls
from linserve.server.engine.types import GenerationRequest, Output


class EngineUnavailable(Exception):
    """The engine is down or restarting; the caller should answer 503 (with the reason)."""


class EngineHealth:
    """What the supervisor knows: ``up`` (serving), ``down`` (restarting, with a reason) or
    ``failed`` (gave up restarting: liveness fails). Read by ``/health``."""

    def __init__(self) -> None:
        self.status = "starting"
        self.reason: str | None = None
        self.since = time.time()
        self.pid: int | None = None  # the engine process (None: a thread)

    @property
    def up(self) -> bool:
        return self.status == "up"

    def _set(self, status: str, reason: str | None) -> None:
        self.status, self.reason, self.since = status, reason, time.time()
        metrics.ENGINE_UP.set(1 if status == "up" else 0)

    def set_up(self) -> None:
        self._set("up", None)

    def set_down(self, reason: str) -> None:
        self._set("down", reason)

    def set_failed(self, reason: str) -> None:
        self._set("failed", reason)


class EngineBackend(EngineCalls, Protocol):
    """What the HTTP side needs from an engine: a thread
    (:class:`linserve.server.engine.thread_client.EngineClient`) or a process
    (:class:`linserve.server.engine.process.ProcessEngineClient`)."""

    loop: asyncio.AbstractEventLoop
    health: EngineHealth

    def submit(self, req: GenerationRequest) -> RequestHandle: ...

    def cancel(self, request_id: str, sent_tokens: int | None = None) -> None: ...

    def finish_all(self) -> None: ...

    async def start_async(self) -> None: ...

    async def stop(self) -> None: ...


class RequestHandle:
    """A submitted request as the HTTP layer sees it."""

    def __init__(self, client: EngineBackend, req: GenerationRequest) -> None:
        self.client = client
        self.req = req
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.final: asyncio.Future[Output] = asyncio.get_running_loop().create_future()
        self.sent_tokens = 0
        self.started = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._callbacks: list[Callable[[Output], None]] = []
        self.text = ""  # everything delivered so far
        # For session requests: resolves to True once the new state is stored, False if the
        # store failed (the session then keeps its previous state).
        self.saved: asyncio.Future[bool] | None = None
        # For a choice forked from a shared prefill (n > 1): the prompt tokens that prefill
        # took from the prefix cache.
        self.forked_from: int | None = None

    @property
    def finished(self) -> bool:
        return self.final.done()

    def on_finish(self, fn: Callable[[Output], None]) -> None:
        self._callbacks.append(fn)

    def _push(self, out: Output) -> None:
        self.text += out.text
        self.queue.put_nowait(out)
        if out.finish_reason is not None and not self.final.done():
            self.final.set_result(out)
            for fn in self._callbacks:
                fn(out)

    async def next(self, timeout: float | None = None) -> Output | None:
        """The next delta, with everything else already queued merged into it (so a slow
        reader gets fewer, larger chunks). None if ``timeout`` passes first."""
        if self.queue.empty():
            try:  # asyncio.timeout, not wait_for: no extra task per streamed token
                async with asyncio.timeout(timeout):
                    out = await self.queue.get()
            except TimeoutError:
                return None
        else:
            out = self.queue.get_nowait()
        while out.finish_reason is None and not self.queue.empty():
            out = out.merge(self.queue.get_nowait())
        return out

    def cancel(self) -> None:
        """Stop generating; the session keeps exactly the tokens sent so far."""
        if not self.finished:
            self.client.cancel(self.req.request_id, self.sent_tokens)
