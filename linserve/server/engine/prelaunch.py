"""The engine process, started before the server's own imports.

Each process of a server would import torch and the model code (about 2.5 s of CPU on two
AVX2 cores), the HTTP one FastAPI as well. The engine process used to be spawned once the
HTTP process had done its imports and checked the checkpoint, so the two came one after the
other: 9.7 s to healthy for the shipped 5M-parameter model. Then it was spawned first thing,
importing beside the HTTP process (§67); on two cores the two imports of torch still took
one core's worth each.

``linserve serve`` now imports the engine's modules (torch and the model code) first,
checks the checkpoint quietly (``loading.prepare_early``: the file's metadata read, its
tensor names matched, the family's check done, none of which the engine does again), and
forks the engine process from there (:func:`prelaunch`): it has all that already, and the
HTTP process goes on with its own imports (FastAPI) while the engine loads. No thread of
torch's, no logging and no malloc setting is made before the fork. The forked process
loads the model on the command line's own settings (:func:`waiting_child`) and waits for
the server's settings; it serves that load if they agree on what is loaded (else it loads
again). The HTTP process sends them when it starts its engine (``ProcessEngineClient``,
which :func:`take` s the process instead of spawning one), after its own check (for the
same files, remembered): a bad checkpoint is still one line, and the waiting process, told
no settings come (:func:`cancel`, or the parent's exit: it is a daemon), leaves without a
word. A restarted engine is spawned afresh, as before.

The 0.8B shapes' Q4_K_M file was healthy in 15.0 s when the engine's load waited on the
HTTP process's imports and check; with an early load and a quicker load, in 8.6–10.8 s
(BENCHMARKS.md §67); forked after the check, 10% sooner than spawned (§69).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
from dataclasses import dataclass
from typing import Any


@dataclass
class Prelaunched:
    """A forked engine process waiting for its settings on ``go``, and what it was given:
    the command and output queues, the ready event and the heartbeat (``child_main``'s)."""

    process: Any
    go: Any
    inbox: Any
    outbox: Any
    ready: Any
    heartbeat: Any


_handle: list[Prelaunched | None] = [None]


def prelaunch(argv: list[str]) -> None:
    """Fork the engine process for ``linserve serve argv`` once the engine's modules are
    imported, ahead of the server's own imports, unless the settings put the engine in this
    process (``--engine-mode thread``), ask for ``--help``, or do not parse (the server
    then says why, once)."""
    if any(a in ("-h", "--help") for a in argv):
        return
    try:
        from linserve.server.settings import parse_cli

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            settings = parse_cli(argv)
    except BaseException:  # a bad flag is the server's to report, once
        return
    if settings.engine_mode != "process":
        return
    # the engine's imports (torch, the model code) and the checkpoint's check, which the
    # forked process has with it
    import linserve.server.engine.process  # noqa: F401
    from linserve.server.engine.loading import prepare_early

    prepared = prepare_early(argv)
    ctx = mp.get_context("fork")
    go = ctx.Queue()
    inbox, outbox, ready, heartbeat = channels(ctx)
    process = ctx.Process(target=waiting_child, name="linserve-engine", daemon=True,
                          args=(prepared, go, inbox, outbox, ready, heartbeat))
    process.start()
    _handle[0] = Prelaunched(process, go, inbox, outbox, ready, heartbeat)


def channels(ctx: Any) -> tuple[Any, Any, Any, Any]:
    """What an engine process is given (``child_main``'s): its command and output queues,
    its ready event and its heartbeat (a shared double)."""
    return ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0, lock=False)


def take() -> Prelaunched | None:
    """The prelaunched engine process, once (None where there is none, or it was taken)."""
    handle, _handle[0] = _handle[0], None
    return handle


def cancel() -> None:
    """Tell a prelaunched process that no settings will come: it exits without a word."""
    handle = take()
    if handle is None:
        return
    handle.go.put(None)
    handle.process.join(timeout=0.5)
    if handle.process.is_alive():  # still loading on the command line's settings
        handle.process.kill()


def waiting_child(prepared: Any, go: Any, inbox: Any, outbox: Any, ready: Any,
                  heartbeat: Any) -> None:
    """The forked process: the model loaded on the command line's own settings
    (``prepared``: ``prepare_early``'s, None where they cannot be loaded quietly), then the
    server's settings from ``go`` (None: the server is not starting), then the engine
    (``child_main``, which serves the early load if the settings agree)."""
    from linserve.server.engine.loading import load_prepared
    from linserve.server.engine.process import child_main

    early = None if prepared is None else load_prepared(prepared)
    settings = go.get()
    if settings is not None:
        child_main(settings, inbox, outbox, ready, heartbeat, early)
