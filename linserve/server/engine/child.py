"""The engine process's side: what it runs (:func:`child_main`), the channels it is given
(:func:`channels`), and an engine process forked before the server's own imports that waits
for its settings (:class:`Prelaunched`, :func:`waiting_child`).

It talks to the HTTP process (:mod:`.process`) through two ``multiprocessing`` queues:
- parent → child: ``("submit", (request, state bytes))``, ``("cancel", (id, sent))``,
  ``("finish_all", None)``, ``("stop", None)``;
- child → parent: first the weightless :class:`ModelInfo`, then once per engine iteration
  ``(outputs, metric events, published prefix entries)``, each output
  ``(request id, Output, state bytes)``.
Session states cross as safetensors bytes (the export format), never as pickled tensors.
The child's Prometheus updates are recorded (:class:`_Recorder`) and replayed into the
parent's registry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from linserve.model.heap import trim
from linserve.model.interface import ServedModel, State
from linserve.server import metrics
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.loading import (
    LoadedEngine,
    load_engine,
    load_prepared,
    setup_engine_process,
    state_budget,
)
from linserve.server.engine.progress import ProgressWatch
from linserve.server.engine.types import Output
from linserve.server.settings import Settings

log = logging.getLogger("linserve.engine")
MetricEvent = tuple[str, tuple[tuple[str, str], ...], str, float]


@dataclass
class Prelaunched:
    """A forked engine process waiting for its settings on ``go``, and what it was given:
    the command and output queues, the ready event and the heartbeat (:func:`channels`)."""

    process: Any
    go: Any
    inbox: Any
    outbox: Any
    ready: Any
    heartbeat: Any
    taken: bool = False  # by the server's engine client, which then owns the process

    def cancel(self) -> None:
        """Unless the server took the process: tell it that no settings will come, and it
        exits without a word."""
        if self.taken:
            return
        self.taken = True
        self.go.put(None)
        self.process.join(timeout=0.5)
        if self.process.is_alive():  # still loading on the command line's settings
            self.process.kill()


def channels(ctx: Any) -> tuple[Any, Any, Any, Any]:
    """What an engine process is given (:func:`child_main`'s): its command and output
    queues, its ready event and its heartbeat (a shared double)."""
    return ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0, lock=False)


def waiting_child(prepared: Any, go: Any, inbox: Any, outbox: Any, ready: Any,
                  heartbeat: Any) -> None:
    """A prelaunched process: the model loaded on the command line's own settings
    (``prepared``: ``prepare_early``'s, None where they cannot be loaded quietly), then the
    server's settings from ``go`` (None: the server is not starting), then the engine
    (:func:`child_main`, which serves the early load if the settings agree)."""
    early = None if prepared is None else load_prepared(prepared)
    settings = go.get()
    if settings is not None:
        child_main(settings, inbox, outbox, ready, heartbeat, early)


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
                  "PREFIX_BUDGET", "PREFIX_LONGEST", "PREFIX_SHARED", "PREFIX_EVICTIONS",
                  "PREFIX_REMOTE_HITS", "MEMORY", "SPEC_DRAFT_TOKENS",
                  "SPEC_ACCEPTED_TOKENS", "SPEC_ACCEPTED_BY_POSITION")


def child_main(settings: Settings, inbox: Any, outbox: Any, ready: Any, heartbeat: Any,
               early: LoadedEngine | None = None) -> None:
    """Entry point of the engine process. ``heartbeat`` (a shared double) gets the monotonic
    time at every engine iteration, and during a long one as the engine thread computes
    (:class:`ProgressWatch`), while the command pump is alive: the parent's supervisor reads
    it to tell a stuck engine from a busy one. ``early``: what a prelaunched process loaded
    on the command line's settings (``loading.load_early``), served if ``settings`` agree."""

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
