"""State files: a recurrent model's state as its own ecosystem writes it, beside this
server's own blobs (:mod:`linserve.model.state_blob`). RWKV's "state-tuned" ``.pth`` files
hold one ``blocks.{i}.att.time_state`` ``[H, N, N]`` per layer, the initial state a request
starts from (ai00's and RWKV-Runner's prompt tuning). A family that has such a format gives
its module ``state_from_file(tensors, state)`` and ``state_to_file(state)``; the server only
calls :func:`read` and :func:`write`.

A ``.pth`` is a pickle: it is read with ``torch.load(weights_only=True)`` and nothing that
needs more is unpickled.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from linserve.model.state import State, StateError

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format


def is_state_file(data: bytes) -> bool:
    """Whether ``data`` looks like a ``torch.save`` file (not one of this server's blobs)."""
    return data[:4] == ZIP_MAGIC


def supported(module: Any) -> bool:
    return callable(getattr(module, "state_from_file", None))


def read(module: Any, data: bytes, template: State) -> State:
    """The state a file's tensors describe, written into ``template`` (a fresh one-row
    state); raises :class:`StateError` naming what does not fit."""
    if not supported(module):
        raise StateError("this model has no state-file format (RWKV's .pth state files are "
                         "read by RWKV models)")
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's and torch's own errors, many types
        raise StateError(f"not a weights-only .pth state file ({type(exc).__name__})") from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor)
                                                for v in tensors.values()):
        raise StateError("a state file is a dict of tensors")
    module.state_from_file(tensors, template)
    return template


def write(module: Any, state: State) -> bytes:
    """One row's state as the model's state file (``torch.save`` bytes)."""
    if not supported(module):
        raise StateError("this model has no state-file format")
    return to_bytes(module.state_to_file(state))


def to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as a state file's bytes (``torch.save``)."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()
