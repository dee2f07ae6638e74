"""Named initial states (``--state-dir``), as ai00 serves RWKV's state-tuned files: every
``NAME.pth`` in the folder is a state a request picks by ``"state": "NAME"``. A request
starts from a copy of it and leaves it as it was (a session is the way to keep going). Each
file is read once, at startup, into the model's state (``ServedModel.state_from_bytes``), so
a file of another model, or an unreadable one, is one line before the server takes a
request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from linserve.model import state_files
from linserve.model.interface import ServedModel, State
from linserve.model.state import StateError


@dataclass(frozen=True)
class NamedState:
    """One file's state, its name and the file's digest (for ``GET /v1/states``)."""

    name: str
    state: State
    digest: str
    path: Path


def load_named_states(model: ServedModel, folder: str) -> dict[str, NamedState]:
    """Every ``*.pth`` in ``folder`` by its stem ({} for no folder). Raises
    :class:`StateError` naming a file that does not fit the model, or a missing folder."""
    if not folder:
        return {}
    root = Path(folder)
    if not root.is_dir():
        raise StateError(f"--state-dir {folder}: not a folder")
    out: dict[str, NamedState] = {}
    for path in sorted(root.glob("*.pth")):
        try:
            state, _ = model.state_from_bytes(path.read_bytes())
        except StateError as exc:
            raise StateError(f"{path}: {exc}") from None
        out[path.stem] = NamedState(path.stem, state, state_files.digest(path), path)
    return out
