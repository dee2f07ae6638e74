"""The one adapter between an architecture's module and the server's
:class:`~linserve.model.interface.ServedModel`, for every family.

A module (a :class:`~linserve.model.layers.decoder.DecoderLM`, Qwen3.5's, or the project's
own ``LanguageModel``) provides ``prefill(tokens, state, all_logits, inserts)``,
``prefill_ragged``, ``step``, ``verify``, ``new_state(batch, max_context)``, ``n_params`` and
``drop_weights``, and may provide ``draft_head``. The family describes it once
(:func:`describe`); this class adds the tokenizer, the chat template, the fingerprint, the
state codec, the encoders of items that are not text, and the prefill's split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from linserve.model import invariant, kernels, modes, packing, state_files
from linserve.model.fingerprint import short_digest
from linserve.model.inputs import Encoder, InsertTable
from linserve.model.interface import DraftHead, ModelInfo
from linserve.model.state import State
from linserve.model.state_blob import state_from_bytes, state_to_bytes
from linserve.model.tokenizer import TextTokenizer
from linserve.model.verify import Trail, keep


def describe(module: Any, architecture: str, context_limit: int | None, per_token: int,
             decode_step: str | None = None, ragged_prefill: bool = True) -> ModelInfo:
    """The :class:`ModelInfo` of ``module`` as loaded (weights on the meta device: a model
    described without its weights, 0 bytes). ``per_token``: the state bytes each token of
    context adds; ``decode_step``: what runs a step (default: one native call where the
    kernels are built)."""
    empty = module.new_state(1, context_limit)
    first = next(module.parameters())
    described = first.is_meta  # no weights were read
    return ModelInfo(
        architecture=architecture, vocab_size=module.cfg.vocab_size,
        context_limit=context_limit, params=module.n_params(),
        dtype=str(first.dtype).removeprefix("torch."),
        decode_step=decode_step or ("fused (whole model, one native call)"
                                    if kernels.available() else "eager"),
        ragged_prefill=ragged_prefill, state_bytes=empty.nbytes, state_grows=empty.grows,
        state_layout=empty.layout(), state_bytes_per_token=per_token,
        weight_bytes=0 if described else packing.resident_bytes(module),
        embedding_bytes=0 if described else packing.embedding_bytes(module),
        quantization=modes.quantization(), kv_cache_dtype=empty.kv_dtype)


class ServedModule:
    """``module`` behind the server's interface (see the module docstring). ``fp``: the
    weights' fingerprint, or what computes it on first use (only states and shared prefixes
    need it); ``chunk``: the prefill's chunk, which a prompt's split keeps to."""

    def __init__(self, module: Any, tok: TextTokenizer, template: str | None,
                 fp: str | Callable[[], str], info: ModelInfo, chunk: int = 64) -> None:
        self.module, self._tok, self._template = module, tok, template
        # states of quantized weights are not interchangeable with the unquantized ones'
        quant = modes.quantization()
        self._fp_of, self._fp_suffix = fp, "" if quant == "none" else f"-{quant}"
        self._fp: str | None = None
        self.chunk, self.info = chunk, info
        self.context_limit = info.context_limit
        self._encoders: dict[str, Encoder] = {}
        self._initial: State | None = None

    def fingerprint(self) -> str:
        if self._fp is None:
            fp = self._fp_of if isinstance(self._fp_of, str) else self._fp_of()
            self._fp = fp + self._fp_suffix
        return self._fp

    def drop_weights(self) -> None:
        self.module.drop_weights()

    def tokenizer(self) -> TextTokenizer:
        return self._tok

    def chat_template(self) -> str | None:
        return self._template

    def new_state(self, batch: int = 1) -> State:
        if self._initial is not None:
            return State.cat([self._initial] * batch).copy()
        state: State = self.module.new_state(batch, self.context_limit)
        return state

    def prefill(self, tokens: torch.Tensor, state: State | None = None,
                all_logits: bool = False, inserts: InsertTable | None = None,
                room: int = 0) -> tuple[torch.Tensor, State]:
        if state is None:
            state = self.new_state(tokens.shape[0])
        out: tuple[torch.Tensor, State] = self.module.prefill(tokens, state, all_logits,
                                                              inserts, room)
        return out

    def encoders(self) -> dict[str, Encoder]:
        return dict(self._encoders)

    def add_encoder(self, kind: str, encoder: Encoder) -> None:
        """Take items of ``kind`` from now on (``info.input_kinds`` says so; an image
        encoder's ``spec``, how an image becomes tokens, is ``info.image_spec``)."""
        self._encoders[kind] = encoder
        spec = getattr(encoder, "spec", None) if kind == "image" else self.info.image_spec
        self.info = dataclasses.replace(self.info, input_kinds=tuple(self._encoders),
                                        image_spec=spec)

    def prefill_ragged(self, prompts: list[list[int]], states: list[State | None]
                       ) -> tuple[torch.Tensor, list[State]]:
        out: tuple[torch.Tensor, list[State]] = self.module.prefill_ragged(prompts, states)
        return out

    def step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        logits: torch.Tensor = self.module.step(tokens, state)
        return logits

    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, Trail]:
        out: tuple[torch.Tensor, Trail] = self.module.verify(tokens, state)
        return out

    def keep(self, state: State, trail: Trail, fed: torch.Tensor) -> None:
        keep(state, trail, fed)

    def draft_head(self) -> DraftHead | None:
        head: DraftHead | None = getattr(self.module, "draft_head", lambda: None)()
        return head

    def prefill_split(self, todo: int, cap: int, budget: int) -> int:
        return invariant.prefill_split(todo, cap, budget, self.chunk)

    def state_to_bytes(self, state: State, extra: dict[str, Any] | None = None,
                       file_format: str = "blob") -> bytes:
        if file_format == "pth":
            return state_files.write(self.module, state)
        return state_to_bytes(state, self.fingerprint(), extra)

    def state_from_bytes(self, data: bytes) -> tuple[State, dict[str, Any]]:
        if state_files.is_state_file(data):
            fresh = self.module.new_state(1, self.context_limit)
            return state_files.read(self.module, data, fresh), {"tokens": 0, "pending": []}
        return state_from_bytes(data, self.new_state(1), self.fingerprint())

    def set_initial_state(self, path: Path) -> None:
        """Start every new state from the state file at ``path`` (``--initial-state``);
        the fingerprint takes its digest, so that states and shared prefixes made from it
        are never mixed with another's. Raises :class:`StateError`."""
        self.set_initial_state_bytes(path.read_bytes())

    def set_initial_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`set_initial_state` from a state file's tensors (a ``.pth`` checkpoint
        that holds its tuned state beside its weights)."""
        self.set_initial_state_bytes(state_files.to_bytes(tensors))

    def set_initial_state_bytes(self, data: bytes) -> None:
        fresh = self.module.new_state(1, self.context_limit)
        self._initial = state_files.read(self.module, data, fresh)
        self._fp_suffix += "-s" + short_digest(data)
        self._fp = None
