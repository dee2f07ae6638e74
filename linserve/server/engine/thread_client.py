"""The engine as a thread of the HTTP process (``--engine-mode thread``, the debugging mode:
a stalled engine thread is reported by ``/health`` but cannot be restarted). The model is
loaded here, so this process imports torch; requests and outputs cross the same border as
with an engine process (:mod:`.calls`: states as blobs), so the HTTP side cannot tell the
two apart. One ``call_soon_threadsafe`` per engine iteration carries all deltas."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from linserve.model.blob_view import StateBlob
from linserve.model.interface import ServedModel, StateError
from linserve.server.engine import calls
from linserve.server.engine.calls import describe, give_output, take_request
from linserve.server.engine.client import EngineHealth, RequestHandle
from linserve.server.engine.description import ModelDescription
from linserve.server.engine.engine import Engine, EngineLimits, Sink
from linserve.server.engine.loading import load_engine
from linserve.server.engine.progress import ProgressWatch
from linserve.server.engine.sizing import state_budget
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.settings import Settings


async def start_thread_engine(settings: Settings) -> tuple[EngineClient, ModelDescription]:
    """Load the model here (off the event loop), start the engine thread on it, and
    describe it as an engine process would."""
    loaded = await asyncio.to_thread(load_engine, settings)
    model, draft = loaded.model, loaded.draft
    limits = EngineLimits(settings.max_running, settings.max_waiting,
                          settings.prefill_chunk, settings.step_token_budget,
                          settings.prefix_cache_bytes, settings.prefix_cache_interval,
                          state_budget(settings, model.info))
    client = EngineClient(
        model, lambda deliver, beat: Engine(model, limits, deliver, beat,
                                            speculative=settings.speculative, draft=draft),
        settings.engine_stall_seconds)
    description = await asyncio.to_thread(describe, model, settings)
    await client.start_async()
    return client, description


EngineFactory = Callable[[Callable[[list[tuple[Sink, Output]]], None], Callable[[], None]],
                         Engine]


class EngineClient:
    """Starts the engine thread and routes its deltas to request handles (the debugging
    mode: a stalled engine thread is reported by ``/health`` but cannot be restarted)."""

    def __init__(self, model: ServedModel, engine_factory: EngineFactory,
                 stall_seconds: float = 10.0) -> None:
        self.loop = asyncio.get_running_loop()
        self.model = model
        self.last_beat = time.monotonic()
        self.stall_seconds = stall_seconds
        self.engine = engine_factory(self._deliver, self._beat)
        self.thread = threading.Thread(target=self.engine.run, name="engine", daemon=True)
        self.health = EngineHealth()
        self._watchdog: asyncio.Task[None] | None = None

    def _beat(self) -> None:
        self.last_beat = time.monotonic()

    def start(self) -> None:
        self.thread.start()
        ProgressWatch.start(self.thread, self._beat, self.stall_seconds)
        self.health.set_up()

    async def start_async(self) -> None:
        self.start()
        self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            stalled = time.monotonic() - self.last_beat
            if not self.thread.is_alive():
                self.health.set_failed("the engine thread exited")
            elif stalled > self.stall_seconds:
                self.health.set_down(f"the engine made no progress for {stalled:.1f} s")
            elif not self.health.up:
                self.health.set_up()

    def cancel(self, request_id: str, sent_tokens: int | None = None) -> None:
        self.engine.cancel(request_id, sent_tokens)

    def finish_all(self) -> None:
        self.engine.finish_all()

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.engine.stop()
        await asyncio.to_thread(self.thread.join, 10)

    def _deliver(self, batch: list[tuple[Sink, Output]]) -> None:
        """Called on the engine thread once per iteration: final states become blobs, as
        the engine process sends them."""
        batch = [(sink, give_output(self.model, out)) for sink, out in batch]
        self.loop.call_soon_threadsafe(dispatch, batch)

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``Overloaded`` when the engine is at capacity."""
        handle = RequestHandle(self, req)
        try:
            taken = take_request(self.model, req)
        except StateError as exc:  # as the engine process answers a blob it cannot read
            handle._push(Output(finish_reason="error", error=f"the engine rejected the "
                                f"request: {exc}"))
            return handle
        self.engine.submit(taken, handle._push)
        return handle

    async def import_state(self, data: bytes) -> tuple[StateBlob, dict[str, Any]]:
        return await asyncio.to_thread(calls.import_state, self.model, data)

    async def state_file(self, state: StateBlob, extra: dict[str, Any]) -> bytes:
        return await asyncio.to_thread(calls.state_file, self.model, state, extra)


def dispatch(batch: list[tuple[Sink, Output]]) -> None:
    """Hand each delta of an engine iteration to its request's sink."""
    for sink, out in batch:
        sink(out)
