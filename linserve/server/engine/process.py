"""The engine in its own process, so that decoding and the HTTP event loop never compete for
one GIL (measured: with the engine as a thread, the server used 0.9 of 2 cores at 64
streaming clients and a batch-64 step took twice as long as alone).

Parent and child talk through two ``multiprocessing`` queues:
- parent → child: ``("submit", (request, state bytes))``, ``("cancel", (id, sent))``,
  ``("finish_all", None)``, ``("stop", None)``;
- child → parent: once per engine iteration, ``(outputs, metric events)`` where each output
  is ``(request id, Output, state bytes)``.
Session states cross as safetensors bytes (the export format), never as pickled tensors.
The child's Prometheus updates are recorded and replayed into the parent's registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from linserve.model.heap import trim
from linserve.model.interface import ModelInfo, ServedModel, State
from linserve.server import metrics
from linserve.server.engine import prelaunch
from linserve.server.engine.client import EngineHealth, EngineUnavailable, RequestHandle
from linserve.server.engine.engine import Engine, EngineLimits, Overloaded
from linserve.server.engine.loading import (
    LoadedEngine,
    load_engine,
    setup_engine_process,
    state_budget,
)
from linserve.server.engine.progress import ProgressWatch
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.settings import Settings

log = logging.getLogger("linserve.engine")
MetricEvent = tuple[str, tuple[tuple[str, str], ...], str, float]


class _Recorder:
    """Stands in for a prometheus metric in the child: records calls for the parent."""

    def __init__(self, name: str, sink: list[MetricEvent], lock: threading.Lock,
                 labels: tuple[tuple[str, str], ...] = ()) -> None:
        self.name, self.sink, self.lock, self._labels = name, sink, lock, labels

    def labels(self, **kw: str) -> _Recorder:
        return _Recorder(self.name, self.sink, self.lock, tuple(sorted(kw.items())))

    def _add(self, op: str, value: float) -> None:
        with self.lock:
            self.sink.append((self.name, self._labels, op, float(value)))

    def observe(self, value: float) -> None:
        self._add("observe", value)

    def inc(self, value: float = 1.0) -> None:
        self._add("inc", value)

    def set(self, value: float) -> None:
        self._add("set", value)


ENGINE_METRICS = ("RUNNING", "WAITING", "BATCH_SIZE", "STEP_TIME", "PREFILL_TIME",
                  "QUEUE_TIME", "PROMPT_TOKENS", "PROMPT_COMPUTED", "PROMPT_REUSED",
                  "GENERATION_TOKENS", "REQUESTS", "PREFIX_QUERIES",
                  "PREFIX_HITS", "PREFIX_HIT_RATE", "PREFIX_BYTES", "PREFIX_ENTRIES",
                  "PREFIX_EVICTIONS", "PREFIX_REMOTE_HITS", "MEMORY", "SPEC_DRAFT_TOKENS",
                  "SPEC_ACCEPTED_TOKENS", "SPEC_ACCEPTED_BY_POSITION")


def apply_metric_events(events: list[MetricEvent]) -> None:
    """Replay the child's metric calls into this process's registry (last set wins)."""
    for name, labels, op, value in events:
        metric: Any = getattr(metrics, name)
        if labels:
            metric = metric.labels(**dict(labels))
        getattr(metric, op)(value)


def child_main(settings: Settings, inbox: Any, outbox: Any, ready: Any, heartbeat: Any,
               early: LoadedEngine | None = None) -> None:
    """Entry point of the engine process. ``heartbeat`` (a shared double) gets the monotonic
    time at every engine iteration, and during a long one as the engine thread computes
    (:class:`ProgressWatch`), while the command pump is alive: the parent's supervisor reads
    it to tell a stuck engine from a busy one. ``early``: what a prelaunched process loaded
    on the command line's settings (:func:`load_early`), served if ``settings`` agree."""

    setup_engine_process(settings)
    events: list[MetricEvent] = []
    lock = threading.Lock()
    for name in ENGINE_METRICS:
        setattr(metrics, name, _Recorder(name, events, lock))
    if early is None or not early.serves(settings):
        early = None  # freed before the load that replaces it
        early = load_engine(settings)
    model, draft = early.model, early.draft

    def take_events() -> list[MetricEvent]:
        with lock:
            out = events[:]
            events.clear()
        return out

    def deliver(batch: list[tuple[Any, Output]]) -> None:
        wire = []
        for rid, out in batch:
            blob = None
            if out.final_state is not None:
                blob = model.state_to_bytes(out.final_state)
                out = dataclasses.replace(out, final_state=None)
            wire.append((rid, out, blob))
        outbox.put((wire, take_events(), []))

    def publish(tokens: list[int], state: State) -> None:  # a prefix entry for Redis
        outbox.put(([], [], [(tokens, model.state_to_bytes(state))]))

    limits = EngineLimits(settings.max_running, 10**9, settings.prefill_chunk,
                          settings.step_token_budget, settings.prefix_cache_bytes,
                          settings.prefix_cache_interval,  # the parent enforces the queue
                          state_budget(settings, model.info))
    pump_thread: threading.Thread | None = None

    def beat() -> None:
        if pump_thread is not None and pump_thread.is_alive():
            heartbeat.value = time.monotonic()

    shared = settings.session_store != "memory"
    engine = Engine(model, limits, deliver, beat, publish if shared else None,
                    speculative=settings.speculative, draft=draft)
    pump_thread = threading.Thread(target=_pump, name="pump", daemon=True,
                                   args=(inbox, outbox, model, engine))

    parent = os.getppid()

    def flush_metrics() -> None:  # gauges must move while idle too
        while True:
            time.sleep(0.1)
            if os.getppid() != parent:  # the server died, even by SIGKILL: do not outlive it
                log.error("the server process is gone; the engine process exits")
                os._exit(1)
            pending = take_events()
            if pending:
                outbox.put(([], pending, []))

    outbox.put(model.info)  # the first message: the parent describes the model without weights
    pump_thread.start()
    threading.Thread(target=flush_metrics, daemon=True).start()
    ready.set()
    # A vocabulary read later (decoding needs only its byte table) is read now, once the
    # server is ready: reading it holds the GIL for half a second a 250k-token one.
    model.tokenizer().prefetch(then=trim)
    # Long steps beat from inside the work: the engine thread's CPU clock (progress.py).
    ProgressWatch.start(threading.current_thread(), beat, settings.engine_stall_seconds)
    engine.run()


def _pump(inbox: Any, outbox: Any, model: ServedModel, engine: Engine) -> None:
    """The child's command thread. A command that fails is answered for its own request (an
    error output) and the pump goes on; if the pump itself ever dies, the heartbeat stops
    and the parent restarts the process."""
    while True:
        cmd, arg = inbox.get()
        try:
            if cmd == "submit":
                req, blob = arg
                if blob is not None:
                    req.start_state = model.state_from_bytes(blob)[0]
                if req.prefix_blob is not None:
                    req.prefix_state = model.state_from_bytes(req.prefix_blob)[0]
                    req.prefix_blob = None
                engine.submit(req, req.request_id)
            elif cmd == "cancel":
                engine.cancel(*arg)
            elif cmd == "finish_all":
                engine.finish_all()
            elif cmd == "stop":
                engine.stop()
                return
        except Exception as exc:
            log.exception("engine command %r failed", cmd)
            if cmd == "submit":
                out = Output(finish_reason="error", error=f"the engine rejected the request: "
                             f"{exc}")
                outbox.put(([(arg[0].request_id, out, None)], [], []))


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

    def __init__(self, settings: Settings, model: ServedModel | None = None) -> None:
        """``model``: the weightless description (:func:`describe_model`); it may be set
        after :meth:`start_async` began (the engine loads while this process describes), but
        before the first request."""
        self.loop = asyncio.get_running_loop()
        self.settings = settings
        self.model = cast(ServedModel, model)
        self.ctx = mp.get_context("spawn")
        self.handles: dict[str, RequestHandle] = {}
        self.capacity = settings.max_running + settings.max_waiting
        self.health = EngineHealth()
        self.generation = 0
        self._restart_times: list[float] = []
        self._watchdog: asyncio.Task[None] | None = None
        self.proc: Any = None
        self.on_publish: Callable[[list[int], bytes], None] | None = None  # prefix entries

    async def start_async(self) -> None:
        await self._spawn()
        self.health.set_up()
        self._watchdog = asyncio.create_task(self._watch())

    async def _spawn(self) -> None:
        """Start a fresh engine process (new queues: a killed process may leave the old ones
        locked) and its reader thread; returns once the model is loaded and warm."""
        self.generation += 1
        early = prelaunch.take() if self.generation == 1 else None
        if early is not None and not early.process.is_alive():
            early = None  # it died waiting (killed from outside): spawn one as usual
        if early is not None:  # spawned by `linserve serve` first thing, imported by now
            self.inbox, outbox, ready = early.inbox, early.outbox, early.ready
            self.heartbeat, self.proc = early.heartbeat, early.process
            early.go.put(self.settings)
        else:
            self.inbox, outbox, ready, self.heartbeat = prelaunch.channels(self.ctx)
            self.proc = self.ctx.Process(target=child_main, name="linserve-engine",
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
        self.engine_info: ModelInfo = await asyncio.to_thread(outbox.get, True, 60.0)
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
        blob = None
        if req.start_state is not None:
            blob = self.model.state_to_bytes(req.start_state)
        self.inbox.put(("submit", (dataclasses.replace(req, start_state=None), blob)))
        return handle

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

    def _read(self, outbox: Any, proc: Any, generation: int) -> None:
        """Reader thread of one engine process: decode states here (off the event loop),
        then hand over. Ends when its process is gone and its queue is drained."""
        while generation == self.generation:
            try:
                wire, events, published = outbox.get(timeout=0.2)
            except queue.Empty:
                if not proc.is_alive():
                    return
                continue
            except (EOFError, OSError):
                return
            decoded = []
            for rid, out, blob in wire:
                if blob is not None:
                    out.final_state = self.model.state_from_bytes(blob)[0]
                decoded.append((rid, out))
            self.loop.call_soon_threadsafe(self._dispatch, decoded, events, generation)
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
