"""What the HTTP process knows of the model the engine serves (:class:`ModelDescription`),
torch-free: the engine process describes its loaded model (:func:`linserve.server.engine.
calls.describe`) and sends this once, before its first output; the thread mode makes the
same object in-process.

The HTTP process never imports torch or the model code: it tokenises, renders templates,
places images and holds states as blobs (:class:`~linserve.model.blob_view.StateBlob`);
what needs the model (a state file read, a blob checked, a ``.pth`` written) is an engine
call (:class:`EngineCalls`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from linserve.model.blob_view import StateBlob
from linserve.model.info import ModelInfo
from linserve.model.tokenizer import TextTokenizer
from linserve.server.sessions.named_states import NamedState


@dataclass
class ModelDescription:
    """The served model without its weights. ``fp``: the fingerprint blobs and shared
    prefixes carry; ``template``: the checkpoint's chat template (None: the plain one);
    ``named_states``: ``--state-dir``'s states, read by the engine; ``dtype``: the weights'
    dtype and why; ``bf16_gemm``, ``kernels`` and ``kernel_build_seconds``: what the engine's
    kernels are (``/health`` and the startup log)."""

    info: ModelInfo
    fp: str
    template: str | None
    tok: TextTokenizer
    named_states: dict[str, NamedState] = field(default_factory=dict)
    dtype: tuple[str, str] = ("float32", "")
    bf16_gemm: str = "aten"
    kernels: str = ""
    kernel_build_seconds: float = 0.0

    def fingerprint(self) -> str:
        return self.fp

    def tokenizer(self) -> TextTokenizer:
        return self.tok

    def chat_template(self) -> str | None:
        return self.template


class EngineCalls(Protocol):
    """What the HTTP process asks of the model through the engine (an engine process's
    queue, or the thread mode's model): each raises
    :class:`~linserve.model.info.StateError` for bytes the model cannot use."""

    async def import_state(self, data: bytes) -> tuple[StateBlob, dict[str, Any]]:
        """A blob or a model's own state file, validated: its state as a blob, and what
        else it carried (``extra``)."""
        ...

    async def state_file(self, state: StateBlob, extra: dict[str, Any]) -> bytes:
        """A state as the model's own state file (RWKV's ``.pth``)."""
        ...
