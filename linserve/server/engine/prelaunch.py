"""The engine process, forked before the server's own imports.

The HTTP process imports no torch and no model code; the engine process imports both, and
on two cores the two imports run side by side. ``linserve serve`` therefore forks the engine
process first thing (:func:`prelaunch`), before either import: the forked process
(``child.waiting_child``) imports the engine's modules, checks the checkpoint quietly
(``loading.check_early``: its memory, its family's checks, a speculative config, state
files) and puts the verdict on a queue, then loads the model on the command line's own
settings and waits for the server's. The HTTP process meanwhile imports FastAPI, reads the
verdict before it says anything (:meth:`~.channels.Prelaunched.wait_verdict`: a bad
checkpoint is one line and exit status 1, the waiting process told that no settings come),
and sends its settings when it starts its engine (``ProcessEngineClient``); the early load
is served if they agree on what is loaded (else it loads again). A restarted engine is
spawned afresh.

Nothing but the settings' parse runs before the fork: no thread, no logging, no malloc
setting.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp

from linserve.server.engine.channels import Prelaunched, channels, waiting_entry


def prelaunch(argv: list[str]) -> Prelaunched | None:
    """Fork the engine process for ``linserve serve argv`` ahead of the server's own
    imports; None (nothing forked) where the settings put the engine in this process
    (``--engine-mode thread``), ask for ``--help``, or do not parse (the server then says
    why, once)."""
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
    ctx = mp.get_context("fork")
    verdict, go = ctx.Queue(), ctx.Queue()
    inbox, outbox, ready, heartbeat = channels(ctx)
    process = ctx.Process(target=waiting_entry, name="linserve-engine", daemon=True,
                          args=(argv, verdict, go, inbox, outbox, ready, heartbeat))
    process.start()
    return Prelaunched(process, verdict, go, inbox, outbox, ready, heartbeat)
