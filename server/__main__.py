"""``python -m server``: start the server (``--help`` lists every setting)."""

from __future__ import annotations

import logging

import uvicorn

from server.app import create_app, wrap
from server.settings import parse_cli


def max_state_bytes(settings_weights: object) -> int:
    """Upper bound on an importable state's size for the configured model."""
    from model.config import ModelConfig
    from model.state import KVCache, LinearState

    cfg = ModelConfig.load(f"{settings_weights}/config.json")
    if cfg.is_recurrent:
        return LinearState.empty(cfg, 1).nbytes + (1 << 16)
    per_pos = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 4
    return per_pos * cfg.max_context + KVCache.empty(cfg, 1).lengths.numel() * 8 + (1 << 16)


def main() -> None:
    settings = parse_cli()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = wrap(create_app(settings), settings, max_state_bytes(settings.weights))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None,
                access_log=False)


if __name__ == "__main__":
    main()
