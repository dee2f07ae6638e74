"""The project's own checkpoints (``config.json`` with an ``attention`` field,
``model.safetensors``, ``tokenizer.json``) behind :class:`model.interface.ServedModel`: the
linear, gated linear, FAVOR+, softmax and sliding-window models, one family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from model import invariant
from model.config import ModelConfig
from model.interface import ModelInfo
from model.state import State
from model.state_blob import state_from_bytes, state_to_bytes
from model.tokenizer import Tokenizer
from model.transformer import LanguageModel, empty_state, load_model


def is_own_checkpoint(path: Path) -> bool:
    """An own checkpoint's config names its attention."""
    try:
        return "attention" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def max_state_bytes(path: Path) -> int:
    """The largest one-row state this checkpoint can have (a full KV cache), without loading
    weights: the bound of an importable blob."""
    cfg = ModelConfig.load(path / "config.json")
    state = empty_state(cfg, 1)
    per_slot = sum(e.nbytes // e.capacity for e in state.kv_entries)
    slots = cfg.window or cfg.max_context
    return state.nbytes + per_slot * slots


class OwnModel:
    """A loaded :class:`LanguageModel` and its tokenizer, as a served model."""

    def __init__(self, model: LanguageModel, tok: Tokenizer) -> None:
        self.model = model
        self._tok = tok
        cfg = model.cfg
        empty = model.new_state(1)
        self.info = ModelInfo(
            architecture=cfg.kind, vocab_size=cfg.vocab_size,
            context_limit=cfg.context_limit, params=model.n_params(),
            dtype=str(model.dtype).removeprefix("torch."),
            decode_step="fused" if model.uses_fused_step else "eager",
            ragged_prefill=cfg.is_recurrent, state_bytes=empty.nbytes,
            state_grows=empty.grows, state_layout=empty.layout(),
            state_bytes_per_token=0 if not empty.grows else
            2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 4,
            weight_bytes=invariant.resident_bytes(model, model.fused_weights),
            embedding_bytes=invariant.embedding_bytes(model),
            quantization=invariant.quantization())

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype, fused: bool, weights: bool = True
             ) -> OwnModel:
        """The checkpoint, weights included whatever ``weights`` says (a few MB)."""
        model = load_model(path, dtype, fused=fused)
        tok = Tokenizer.from_file(path / model.cfg.tokenizer)
        if tok.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} tokens, model "
                             f"{model.cfg.vocab_size}")
        return cls(model, tok)

    def drop_weights(self) -> None:
        """Kept: the project's models are a few MB."""

    def fingerprint(self) -> str:
        quant = self.info.quantization  # quantized weights' states are not interchangeable
        return self.model.fingerprint() + ("" if quant == "none" else f"-{quant}")

    def tokenizer(self) -> Tokenizer:
        return self._tok

    def chat_template(self) -> str | None:
        return None

    def new_state(self, batch: int = 1) -> State:
        return self.model.new_state(batch)

    def prefill(self, tokens: torch.Tensor, state: State | None = None,
                all_logits: bool = False) -> tuple[torch.Tensor, State]:
        return self.model.prefill(tokens, state, all_logits)

    def prefill_ragged(self, prompts: list[list[int]], states: list[State | None]
                       ) -> tuple[torch.Tensor, list[State]]:
        return self.model.prefill_ragged(prompts, states)

    def step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        return self.model.step(tokens, state)

    def prefill_split(self, todo: int, cap: int, budget: int) -> int:
        return invariant.prefill_split(todo, cap, budget, self.model.cfg.chunk_size)

    def state_to_bytes(self, state: State, extra: dict[str, Any] | None = None) -> bytes:
        return state_to_bytes(state, self.fingerprint(), extra)

    def state_from_bytes(self, data: bytes) -> tuple[State, dict[str, Any]]:
        return state_from_bytes(data, self.model.new_state(1), self.fingerprint())
