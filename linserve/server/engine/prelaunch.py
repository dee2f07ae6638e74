"""The engine process, forked before the server's own imports.

Each process of a server would import torch and the model code, the HTTP one FastAPI as
well; on two cores, two imports side by side still take one core's worth each.
``linserve serve`` therefore imports the engine's modules (torch and the model code) first,
checks the checkpoint quietly (``loading.prepare_early``: the file's metadata read, its
tensor names matched, the family's check done, none of which the engine does again), and
forks the engine process from there (:func:`prelaunch`): it has all that already, and the
HTTP process goes on with its own imports (FastAPI) while the engine loads.

No thread of torch's, no logging and no malloc setting is made before the fork. The forked
process (``child.waiting_child``) loads the model on the command line's own settings and
waits for the server's; it serves that load if they agree on what is loaded (else it loads
again). The HTTP process is handed the :class:`~.child.Prelaunched` handle and sends the
settings when it starts its engine (``ProcessEngineClient``), after its own check (for the
same files, remembered): a bad checkpoint is still one line, and the waiting process, told
no settings come (``Prelaunched.cancel``, or the parent's exit: it is a daemon), leaves
without a word. A restarted engine is spawned afresh.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp

from linserve.server.engine.child import Prelaunched, channels, waiting_child


def prelaunch(argv: list[str]) -> Prelaunched | None:
    """Fork the engine process for ``linserve serve argv`` once the engine's modules are
    imported, ahead of the server's own imports; None (nothing forked) where the settings
    put the engine in this process (``--engine-mode thread``), ask for ``--help``, or do
    not parse (the server then says why, once)."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    try:
        from linserve.server.settings import parse_cli

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            settings = parse_cli(argv)
    except BaseException:  # a bad flag is the server's to report, once
        return None
    if settings.engine_mode != "process":
        return None
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
    return Prelaunched(process, go, inbox, outbox, ready, heartbeat)
