"""Where the server keeps what it builds once (the kernels, GGUF vocabularies), torch-free:
both processes find a kept vocabulary there."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LINSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/linserve`` or ``~/.cache/linserve``."""
    return Path(os.environ.get("LINSERVE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "linserve")
