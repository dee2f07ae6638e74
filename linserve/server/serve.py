"""``linserve serve``: start the server (``--help`` lists every setting)."""

from __future__ import annotations

import logging
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from linserve import __version__
from linserve.model.checkpoint_path import tokenizer_source
from linserve.model.info import CheckpointError
from linserve.model.tokenizer import preread
from linserve.server.api.app import create_app, wrap
from linserve.server.engine.prelaunch import prelaunch
from linserve.server.engine.sizing import resolve_checkpoint
from linserve.server.settings import Settings, parse_cli
from linserve.server.system.malloc import pin_mmap_threshold

if TYPE_CHECKING:
    from linserve.server.engine.channels import Prelaunched

log = logging.getLogger("linserve")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: mark the app draining (health 503, new requests 503), let
    in-flight streams run, and end the ones still running cleanly (finish_reason "length",
    then ``[DONE]``) just before the grace period runs out."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float) -> None:
        super().__init__(config)
        self.fastapi_app, self.grace = app, grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self.fastapi_app.state
        if not state.draining:
            state.draining = True
            client = getattr(state, "client", None)
            if client is not None:
                deadline = max(self.grace - 1.0, 0.0)
                client.loop.call_later(deadline, client.finish_all)
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None, boot: float | None = None,
         prelaunched: Prelaunched | None = None) -> None:
    """Parse the settings from ``argv`` (default: ``sys.argv[1:]``), have the checkpoint
    checked (a bad one is one line and exit status 1) and serve until SIGTERM / SIGINT.
    ``boot``: the command's start (``time.monotonic()``; default now), which the ready line
    counts from. ``prelaunched``: the engine process ``linserve serve`` forked first thing,
    if any (else one is forked here, where the engine runs in a process of its own)."""
    boot = time.monotonic() if boot is None else boot
    args = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_cli(args)
    except ValidationError as exc:  # a bad flag or variable: say which, without a traceback
        raise SystemExit(f"linserve: invalid settings\n{exc}") from None
    own = prelaunched is None and settings.engine_mode == "process"
    if own:
        prelaunched = prelaunch(args)
    try:
        serve(settings, boot, prelaunched)
    finally:
        if own and prelaunched is not None:
            prelaunched.cancel()


def checked(settings: Settings, prelaunched: Prelaunched | None) -> tuple[Settings, int]:
    """``settings`` resolved, and the largest state an import may send, once the checkpoint
    passed its checks: the engine process's (``prelaunched``'s verdict), or this process's
    in the thread mode. Raises SystemExit with the one line saying why it cannot load."""
    try:
        settings = resolve_checkpoint(settings)
    except (CheckpointError, OSError, ValueError) as exc:
        raise SystemExit(f"linserve: cannot load {settings.model or settings.weights}: "
                         f"{exc}") from None
    if prelaunched is not None:
        source = tokenizer_source(settings.weights)
        if source is not None:  # read here while the engine process imports torch
            preread(source)
        problem, state_limit = prelaunched.wait_verdict()
    else:  # the engine runs in this process, which imports the model code anyway
        from linserve.server.engine.loading import check_settings

        try:
            problem, state_limit = None, check_settings(settings)[0]
        except (CheckpointError, OSError, ValueError) as exc:
            problem = f"cannot load {settings.model or settings.weights}: {exc}"
    if problem is not None:
        raise SystemExit(f"linserve: {problem}")
    if prelaunched is not None and prelaunched.description is not None:
        # its vocabulary, read here while the engine loads (a 250k-token one: 0.9 s)
        prelaunched.description.tokenizer().prefetch()
    return settings, state_limit


def serve(settings: Settings, boot: float, prelaunched: Prelaunched | None) -> None:
    """Serve ``settings`` (parsed) until SIGTERM / SIGINT."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pin_mmap_threshold(settings.malloc_mmap_threshold)
    settings, state_limit = checked(settings, prelaunched)
    log.info("linserve %s: starting %s on %s:%d (engine: %s; every setting: linserve serve "
             "--help)", __version__, settings.model or settings.weights, settings.host,
             settings.port, settings.engine_mode)
    if settings.speculative is not None:
        log.info("speculative decoding: %s", settings.speculative.describe())
    app = create_app(settings)
    app.state.boot_time = boot
    app.state.prelaunched = prelaunched
    config = uvicorn.Config(wrap(app, settings, state_limit),
                            host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=False,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None)
    DrainingServer(config, app, settings.shutdown_grace_seconds).run()


if __name__ == "__main__":
    main()
