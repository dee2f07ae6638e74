"""The HTTP process's side of an engine in its own process, so that decoding and the HTTP
event loop never compete for one GIL (measured: with the engine as a thread, the server used
0.9 of 2 cores at 64 streaming clients and a batch-64 step took twice as long as alone).
The process's own side, and the protocol between the two, are :mod:`.child`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from linserve.model.blob_view import StateBlob
from linserve.model.info import StateError
from linserve.server import metrics
from linserve.server.engine.channels import Prelaunched, channels, engine_entry
from linserve.server.engine.client import EngineHealth, EngineUnavailable, RequestHandle
from linserve.server.engine.description import ModelDescription
from linserve.server.engine.types import GenerationRequest, MetricEvent, Output, Overloaded
from linserve.server.settings import Settings

log = logging.getLogger("linserve.engine")


def apply_metric_events(events: list[MetricEvent]) -> None:
    """Replay the child's metric calls into this process's registry (last set wins)."""
    for name, labels, op, value in events:
        metric: Any = getattr(metrics, name)
        if labels:
            metric = metric.labels(**dict(labels))
        getattr(metric, op)(value)



class ProcessEngineClient:
    """The HTTP process's side: the same interface as
    :class:`linserve.server.engine.client.EngineClient`, plus a supervisor that restarts the engine
    process when it dies or stalls.

    The supervisor polls every 0.1 s: a dead process (any exit, ``kill -9`` included) or a
    heartbeat older than ``engine_stall_seconds`` fails every in-flight request with an
    error (503 / SSE error event), kills what is left, and starts a fresh process. Sessions
    live in the HTTP process's store (or Redis) and are untouched. More than
    ``engine_max_restarts`` restarts within ``engine_restart_window`` seconds and it gives
    up: liveness then fails, so the orchestrator replaces the whole server.
    """

    def __init__(self, settings: Settings, prelaunched: Prelaunched | None = None) -> None:
        """``prelaunched``: an engine process ``linserve serve`` forked first thing
        (:mod:`.prelaunch`), taken as the first engine instead of spawning one. The model's
        :attr:`description` is the engine's first message, once it has loaded."""
        self.loop = asyncio.get_running_loop()
        self.settings = settings
        self.description: ModelDescription
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self.ctx = mp.get_context("spawn")
        self.handles: dict[str, RequestHandle] = {}
        self.capacity = settings.max_running + settings.max_waiting
        self.health = EngineHealth()
        self.generation = 0
        self._restart_times: list[float] = []
        self._watchdog: asyncio.Task[None] | None = None
        self.proc: Any = None
        self.on_publish: Callable[[list[int], bytes], None] | None = None  # prefix entries
        self._prelaunched = prelaunched

    async def start_async(self) -> None:
        await self._spawn()
        self.health.set_up()
        self._watchdog = asyncio.create_task(self._watch())

    async def _spawn(self) -> None:
        """Start a fresh engine process (new queues: a killed process may leave the old ones
        locked) and its reader thread; returns once the model is loaded and warm."""
        self.generation += 1
        early, self._prelaunched = self._prelaunched, None
        if early is not None and (early.taken or not early.process.is_alive()):
            early = None  # it died waiting (killed from outside): spawn one as usual
        if early is not None:  # spawned by `linserve serve` first thing, imported by now
            early.taken = True
            self.inbox, outbox, ready = early.inbox, early.outbox, early.ready
            self.heartbeat, self.proc = early.heartbeat, early.process
            early.go.put(self.settings)
        else:
            self.inbox, outbox, ready, self.heartbeat = channels(self.ctx)
            self.proc = self.ctx.Process(target=engine_entry, name="linserve-engine",
                                         daemon=True, args=(self.settings, self.inbox, outbox,
                                                            ready, self.heartbeat))
            self.proc.start()
        deadline = time.monotonic() + 300.0
        while not await asyncio.to_thread(ready.wait, 0.25):  # short waits: cancellable
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited while loading (exit code "
                                   f"{self.proc.exitcode}); its log says why")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("the engine process did not start within 300 s")
        self.description = await asyncio.to_thread(outbox.get, True, 60.0)
        if early is not None and early.description is not None:
            self.description.tok = early.description.tok  # read here while it loaded
        self.heartbeat.value = time.monotonic()
        self.health.pid = self.proc.pid
        threading.Thread(target=self._read, name="engine-reader", daemon=True,
                         args=(outbox, self.proc, self.generation)).start()

    def submit(self, req: GenerationRequest) -> RequestHandle:
        if not self.health.up:
            raise EngineUnavailable(self.health.reason or "the engine is not running")
        if len(self.handles) >= self.capacity:
            raise Overloaded
        handle = RequestHandle(self, req)
        self.handles[req.request_id] = handle
        self.inbox.put(("submit", req))
        return handle

    async def import_state(self, data: bytes) -> tuple[StateBlob, dict[str, Any]]:
        blob, extra = await self._call("import_state", (data,))
        return blob, extra

    async def state_file(self, state: StateBlob, extra: dict[str, Any]) -> bytes:
        data: bytes = await self._call("state_file", (state, extra))
        return data

    async def _call(self, name: str, args: tuple[Any, ...]) -> Any:
        """Run :data:`.calls.CALLS`' ``name`` on the engine's model; its StateError is
        raised here, anything else a RuntimeError, an engine down EngineUnavailable."""
        if not self.health.up:
            raise EngineUnavailable(self.health.reason or "the engine is not running")
        call_id = next(self._call_ids)
        self._calls[call_id] = answer = self.loop.create_future()
        self.inbox.put(("call", (call_id, name, args)))
        try:
            return await answer
        finally:
            self._calls.pop(call_id, None)

    def _answer(self, call_id: int, status: str, payload: Any) -> None:
        answer = self._calls.get(call_id)
        if answer is None or answer.done():
            return
        if status == "ok":
            answer.set_result(payload)
        else:
            answer.set_exception(StateError(payload) if status == "invalid"
                                 else RuntimeError(payload))

    def cancel(self, request_id: str, sent_tokens: int | None = None) -> None:
        if self.health.up:
            self.inbox.put(("cancel", (request_id, sent_tokens)))

    def finish_all(self) -> None:
        if self.health.up:
            self.inbox.put(("finish_all", None))

    @property
    def inflight(self) -> int:
        return len(self.handles)

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.health.set_down("stopped")
        if self.proc is None:
            return
        self.inbox.put(("stop", None))
        await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.kill()

    # ---- supervision -----------------------------------------------------------------
    def _fault(self) -> str | None:
        """Why the engine process is unusable, or None while it is healthy."""
        if not self.proc.is_alive():
            return f"the engine process exited (exit code {self.proc.exitcode})"
        stalled = time.monotonic() - self.heartbeat.value
        if stalled > self.settings.engine_stall_seconds:
            return f"the engine made no progress for {stalled:.1f} s"
        return None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if not self.health.up:
                continue
            reason = self._fault()
            if reason is not None:
                await self._recover(reason)

    async def _recover(self, reason: str) -> None:
        """Fail in-flight requests, then replace the process (with back-off)."""
        log.error("engine failure: %s; failing %d in-flight requests and restarting",
                  reason, len(self.handles))
        self.health.set_down(reason)
        self._fail_inflight(f"{reason}; the request was not completed")
        if self.proc.is_alive():
            self.proc.kill()
        await asyncio.to_thread(self.proc.join, 5)
        delay = 0.5
        while True:
            now = time.monotonic()
            self._restart_times = [t for t in self._restart_times
                                   if now - t < self.settings.engine_restart_window]
            if len(self._restart_times) >= self.settings.engine_max_restarts:
                self.health.set_failed(f"{reason}; gave up after "
                                       f"{len(self._restart_times)} restarts")
                log.critical("engine restarted too often; giving up (liveness now fails)")
                return
            self._restart_times.append(now)
            try:
                t0 = time.monotonic()
                await self._spawn()
            except Exception:
                log.exception("engine restart failed; retrying in %.1f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            metrics.ENGINE_RESTARTS.inc()
            self.health.set_up()
            log.warning(json.dumps({"event": "engine_restarted", "reason": reason,
                                    "seconds": round(time.monotonic() - t0, 2)}))
            return

    def _fail_inflight(self, message: str) -> None:
        for handle in list(self.handles.values()):
            handle._push(Output(finish_reason="error", error=message, error_status=503))
        self.handles.clear()
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(EngineUnavailable(message))

    def _read(self, outbox: Any, proc: Any, generation: int) -> None:
        """Reader thread of one engine process: unpickle its messages here (off the event
        loop), then hand over. Ends when its process is gone and its queue is drained."""
        while generation == self.generation:
            try:
                outputs, events, published, answers = outbox.get(timeout=0.2)
            except queue.Empty:
                if not proc.is_alive():
                    return
                continue
            except (EOFError, OSError):
                return
            self.loop.call_soon_threadsafe(self._dispatch, outputs, events, generation)
            for answer in answers:
                self.loop.call_soon_threadsafe(self._answer, *answer)
            if published and self.on_publish is not None:
                for tokens, blob in published:
                    self.loop.call_soon_threadsafe(self.on_publish, tokens, blob)

    def _dispatch(self, batch: list[tuple[str, Output]], events: list[MetricEvent],
                  generation: int) -> None:
        apply_metric_events(events)
        if generation != self.generation:
            return  # a dead process's late outputs: its requests were already failed
        for rid, out in batch:
            handle = self.handles.get(rid)
            if out.finish_reason is not None:
                self.handles.pop(rid, None)
            if handle is not None:
                handle._push(out)
