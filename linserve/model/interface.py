"""The one interface between the server and a model, whatever its architecture.

The server (engine, pool, sessions, prefix cache, replay, export/import, ``/health``) holds a
:class:`ServedModel` and the :class:`State` objects it makes, and never asks which
architecture it holds: what it needs to know is in :class:`ModelInfo`, or asked of the state
(``truncatable``, ``grows``, ``nbytes``). Architectures implement the protocol in their own
modules under ``linserve/model/architectures/`` (``linserve.py``: the project's checkpoints), and
:mod:`linserve.model.loader` picks one for a checkpoint folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from linserve.model.info import STATE_FORMAT_VERSION, CheckpointError, ModelInfo, StateError
from linserve.model.inputs import Encoder, InsertTable
from linserve.model.state import State
from linserve.model.tokenizer import TextTokenizer
from linserve.model.verify import Trail

# The state is the server's to hold, copy, compress and ship, never to look inside.
__all__ = ["STATE_FORMAT_VERSION", "CheckpointError", "ModelInfo", "ServedModel", "State",
           "StateError"]


class DraftHead(Protocol):
    """A checkpoint's own draft layers (Qwen3.5's MTP): per request a state, extended from
    the served model's final-norm outputs ``hidden [n, d]`` and the token after each into
    its own hidden states g ``[n, d]``, whose :meth:`logits` ``[n, V]`` draft the token after
    that (g is fed back, with the token drafted, for the next draft)."""

    def new_state(self) -> State:
        ...

    def extend(self, state: State, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        ...

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        ...


class ServedModel(Protocol):
    """A model the server can run. Shapes: tokens ``[B, T]`` for prefill, ``[B]`` for a step;
    logits fp32 ``[B, V]``; a state's rows match the batch."""

    info: ModelInfo

    def fingerprint(self) -> str:
        """A hash of the config and weights; blobs and shared caches carry it."""
        ...

    def tokenizer(self) -> TextTokenizer:
        ...

    def chat_template(self) -> str | None:
        """The checkpoint's Jinja chat template, or None (the server's plain one)."""
        ...

    def new_state(self, batch: int = 1) -> State:
        ...

    def prefill(self, tokens: torch.Tensor, state: State | None = None,
                all_logits: bool = False, inserts: InsertTable | None = None,
                room: int = 0) -> tuple[torch.Tensor, State]:
        """Tokens ``[B, T]`` after ``state`` (None: empty; not modified) -> last logits
        ``[B, V]`` (``[B, T, V]`` with ``all_logits``) and a new state. ``inserts``: the
        embeddings of the items (:mod:`linserve.model.inputs`) whose virtual ids ``tokens``
        holds; only a model with an encoder of their kind is given any. ``room``: the
        tokens still to come in this prompt's prefill, this chunk's included; the new state
        makes room for them, so that the states of one chunked prefill share one buffer of
        keys (:class:`linserve.model.state.SharedKV`)."""
        ...

    def encoders(self) -> dict[str, Encoder]:
        """Its encoders by the kind of item they take (``info.input_kinds``)."""
        ...

    def prefill_ragged(self, prompts: list[list[int]], states: list[State | None]
                       ) -> tuple[torch.Tensor, list[State]]:
        """Prompts of different lengths in one pass (where ``info.ragged_prefill``): each
        one's last logits ``[B, V]`` and its new one-row state."""
        ...

    def step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per row ``[B]`` -> logits ``[B, V]``; advances ``state`` in place."""
        ...

    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, Trail]:
        """Tokens ``[B, T]`` -> logits ``[B, T, V]``, every position's as a step gives it;
        ``state`` advanced by all T in place, and the trail to land on an earlier position
        (speculative decoding, :mod:`linserve.model.verify`)."""
        ...

    def keep(self, state: State, trail: Trail, fed: torch.Tensor) -> None:
        """After :meth:`verify`: put row b after the first ``fed[b]`` of its T tokens."""
        ...

    def draft_head(self) -> DraftHead | None:
        """The checkpoint's own draft layers (MTP), or None."""
        ...

    def prefill_split(self, todo: int, cap: int, budget: int) -> int:
        """How many of ``todo`` prompt tokens to prefill now under a per-call ``cap`` and the
        iteration's ``budget`` (0: wait for the next iteration), so that the result does not
        depend on how the prompt was split."""
        ...

    def state_to_bytes(self, state: State, extra: dict[str, Any] | None = None,
                       file_format: str = "blob") -> bytes:
        """One row's state as this server's blob (``extra``: what else it carries), or
        with ``file_format="pth"`` as the model's own state file (RWKV's ``.pth``; raises
        :class:`StateError` for a model without one)."""
        ...

    def state_from_bytes(self, data: bytes) -> tuple[State, dict[str, Any]]:
        """Parse and validate a blob, or a model's state file; raises :class:`StateError`
        for a bad one."""
        ...

    def set_initial_state(self, path: Path) -> None:
        """Start every new state from the state file at ``path``; raises
        :class:`StateError`."""
        ...

    def set_initial_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`set_initial_state` from a state file's tensors."""
        ...

    def drop_weights(self) -> None:
        """Free the weights where they are large: the model keeps its config, tokenizer and
        state layout (new states, state blobs) but can no longer run. For the HTTP process
        of a server whose engine runs in a process of its own."""
        ...
