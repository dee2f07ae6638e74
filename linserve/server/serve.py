"""``linserve serve``: start the server (``--help`` lists every setting)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from linserve import __version__
from linserve.model import kernels, loader
from linserve.server.api.app import create_app, wrap
from linserve.server.engine.loading import (
    apply_image_settings,
    describe_model,
    resolve_checkpoint,
)
from linserve.server.sessions.named_states import load_named_states
from linserve.server.settings import parse_cli
from linserve.server.speculative.draft import check_speculative
from linserve.server.system.malloc import pin_mmap_threshold

if TYPE_CHECKING:
    from linserve.server.engine.child import Prelaunched

log = logging.getLogger("linserve")


def max_state_bytes(weights: Path) -> int:
    """Upper bound on an importable state's size for the configured model (its largest
    state, plus room for the blob's header)."""
    return loader.max_state_bytes(weights) + (1 << 16)


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
    """Parse the settings from ``argv`` (default: ``sys.argv[1:]``), check the checkpoint
    (a bad one is one line and exit status 1), make the native kernels ready (compiled on a
    machine's first start, and said so) and serve until SIGTERM / SIGINT. ``boot``: the
    command's start (``time.monotonic()``; default now), which the ready line counts from.
    ``prelaunched``: the engine process ``linserve serve`` forked first thing, if any."""
    boot = time.monotonic() if boot is None else boot
    try:
        settings = parse_cli(argv)
    except ValidationError as exc:  # a bad flag or variable: say which, without a traceback
        raise SystemExit(f"linserve: invalid settings\n{exc}") from None
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pin_mmap_threshold(settings.malloc_mmap_threshold)
    try:
        settings = resolve_checkpoint(settings)
        apply_image_settings(settings)  # a vision tower, --mmproj's too, is checked with it
        loader.check(settings.weights, settings.dtype, settings.quantization,
                     settings.max_memory)
        state_limit = max_state_bytes(settings.weights)
        if settings.speculative is not None:
            check_speculative(settings.speculative, settings.weights)
        if settings.initial_state or settings.state_dir:  # read against the model's state,
            load_named_states(describe_model(settings), settings.state_dir)  # before serving
    except (loader.CheckpointError, OSError, ValueError) as exc:  # one line, no traceback
        raise SystemExit(f"linserve: cannot load {settings.model or settings.weights}: "
                         f"{exc}") from None
    log.info("linserve %s: starting %s on %s:%d (engine: %s; every setting: linserve serve "
             "--help)", __version__, settings.model or settings.weights, settings.host,
             settings.port, settings.engine_mode)
    if settings.speculative is not None:
        log.info("speculative decoding: %s", settings.speculative.describe())
    kernels.load()  # here, logged, before either process needs them: a first start compiles
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
