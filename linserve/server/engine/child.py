"""The engine process's side: what it runs (:func:`child_main`), and an engine process
forked before the server's own imports that checks the checkpoint, loads it and waits for
its settings (:func:`waiting_child`). The channels it is given are :mod:`.channels`'.

It talks to the HTTP process (:mod:`.process`) through two ``multiprocessing`` queues:
- parent → child: ``("submit", request)``, ``("cancel", (id, sent))``,
  ``("call", (call id, name, args))`` (:data:`.calls.CALLS`), ``("finish_all", None)``,
  ``("stop", None)``;
- child → parent: first the :class:`~.description.ModelDescription`, then once per engine
  iteration ``(outputs, metric events, published prefix entries, call answers)``, each
  output ``(request id, Output)``, each answer ``(call id, status, result or why)``.
Session states cross as blobs (safetensors bytes, the export format), never as pickled
tensors, and the parent never decodes them: it imports no torch.
The child's Prometheus updates are recorded (:class:`_Recorder`) and replayed into the
parent's registry.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from linserve.model.heap import trim
from linserve.model.interface import ServedModel, State, StateError
from linserve.server import metrics
from linserve.server.engine.calls import CALLS, describe, give_output, take_request
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.loading import (
    LoadedEngine,
    check_early,
    load_engine,
    load_prepared,
    setup_engine_process,
)
from linserve.server.engine.progress import ProgressWatch
from linserve.server.engine.sizing import state_budget
from linserve.server.engine.types import MetricEvent, Output
from linserve.server.settings import Settings

log = logging.getLogger("linserve.engine")


def waiting_child(argv: list[str], verdict: Any, go: Any, inbox: Any, outbox: Any,
                  ready: Any, heartbeat: Any) -> None:
    """A prelaunched process: the checkpoint checked on the command line's own settings
    (``loading.check_early``), the verdict put on ``verdict`` for the HTTP process (a
    problem's one line, or None, the largest importable state and the model described
    without its weights), the model loaded on those settings, then the server's settings
    from ``go`` (None: the server is not starting), then the engine (:func:`child_main`,
    which serves the early load if the settings agree)."""
    settings, problem, state_limit, described = check_early(argv)
    verdict.put((problem, state_limit, described))
    if settings is None:
        return
    early = load_prepared(settings)
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
        outbox.put(([(rid, give_output(model, out)) for rid, out in batch], take_events(),
                    [], []))

    def publish(tokens: list[int], state: State) -> None:  # a prefix entry for Redis
        outbox.put(([], [], [(tokens, model.state_to_bytes(state))], []))

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
                outbox.put(([], pending, [], []))

    outbox.put(describe(model, settings))  # the first message: what the parent serves
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
                engine.submit(take_request(model, arg), arg.request_id)
            elif cmd == "call":
                outbox.put(([], [], [], [answer(model, *arg)]))
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
                outbox.put(([(arg.request_id, out)], [], [], []))


def answer(model: ServedModel, call_id: int, name: str, args: tuple[Any, ...]
           ) -> tuple[int, str, Any]:
    """A call's answer: ``(call_id, "ok", result)``, ``(call_id, "invalid", why)`` for bytes
    the model cannot use (a StateError's message), ``(call_id, "failed", why)`` otherwise."""
    try:
        return call_id, "ok", CALLS[name](model, *args)
    except StateError as exc:
        return call_id, "invalid", str(exc)
    except Exception as exc:  # the caller answers a 500; the engine goes on
        log.exception("engine call %r failed", name)
        return call_id, "failed", f"{type(exc).__name__}: {exc}"
