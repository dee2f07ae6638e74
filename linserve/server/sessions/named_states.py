"""Named initial states (``--state-dir``), as ai00 serves RWKV's state-tuned files: every
``NAME.pth`` in the folder is a state a request picks by ``"state": "NAME"``. A request
starts from a copy of it and leaves it as it was (a session is the way to keep going). The
engine process reads each file once, at startup, into the model's state and hands the HTTP
process its blob (:func:`load_named_states`), so a file of another model, or an unreadable
one, is one line before the server takes a request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linserve.model.blob_view import StateBlob
from linserve.model.fingerprint import short_digest
from linserve.model.info import StateError


@dataclass(frozen=True)
class NamedState:
    """One file's state (as a blob), its name and the file's digest (for
    ``GET /v1/states``)."""

    name: str
    state: StateBlob
    digest: str
    path: Path


def load_named_states(read: Callable[[bytes], StateBlob], folder: str
                      ) -> dict[str, NamedState]:
    """Every ``*.pth`` in ``folder`` by its stem ({} for no folder), each file's bytes made
    a blob by ``read`` (the model's: it validates them). Raises :class:`StateError` naming a
    file that does not fit the model, or a missing folder."""
    if not folder:
        return {}
    root = Path(folder)
    if not root.is_dir():
        raise StateError(f"--state-dir {folder}: not a folder")
    out: dict[str, NamedState] = {}
    for path in sorted(root.glob("*.pth")):
        data = path.read_bytes()
        try:
            state = read(data)
        except StateError as exc:
            raise StateError(f"{path}: {exc}") from None
        out[path.stem] = NamedState(path.stem, state, short_digest(data), path)
    return out
