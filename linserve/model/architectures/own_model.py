"""The project's own checkpoints (``config.json`` with an ``attention`` field,
``model.safetensors``, ``tokenizer.json``): the linear, gated linear, FAVOR+, softmax and
sliding-window models, one family.

- :class:`LanguageModel`: one set of weights, three forms (forward for training, prefill,
  step), over the blocks of :mod:`linserve.model.layers.own` and the fused native step of
  :mod:`linserve.model.layers.own_step`.
- :func:`serve`: a loaded model and its tokenizer behind
  :class:`linserve.model.interface.ServedModel` (the one adapter,
  :class:`linserve.model.served.ServedModule`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from linserve.model import invariant, kernels, modes, packing
from linserve.model.inputs import InsertTable
from linserve.model.interface import ModelInfo
from linserve.model.layers import own_step
from linserve.model.layers.own import Block
from linserve.model.layers.own_step import FusedStep
from linserve.model.own_config import ModelConfig
from linserve.model.served import ServedModule
from linserve.model.state import ConvEntry, KVEntry, RecurrentEntry, State, prefill_state
from linserve.model.tokenizer import Tokenizer
from linserve.model.verify import Trail, verify_by_steps


def empty_state(cfg: ModelConfig, batch: int = 1, kv_dtype: str = "fp32") -> State:
    """An empty state: per layer a recurrent entry (s, z) and the short-conv window for
    linear / FAVOR+ models, a KV cache (a ring for window models) for softmax ones."""
    lengths = torch.zeros(batch, dtype=torch.long)
    if cfg.is_recurrent:
        return State([{"recurrent": RecurrentEntry.empty(batch, cfg.n_heads, cfg.feature_dim,
                                                         cfg.head_dim),
                       "conv": ConvEntry.empty(batch, cfg.conv_size, 3 * cfg.d_model)}
                      for _ in range(cfg.n_layers)], lengths)
    return State([{"kv": KVEntry.empty(batch, cfg.n_heads, cfg.head_dim, cfg.max_context,
                                       cfg.window, dtype=kv_dtype)}
                  for _ in range(cfg.n_layers)], lengths)


class LanguageModel(nn.Module):
    """Decoder-only LM with tied input/output embeddings.

    - ``forward(tokens [B, T]) -> logits [B, T, V]``: parallel form for training.
    - ``prefill(tokens [B, T], state) -> (logits, new_state)``: parallel form continuing a state.
    - ``step(tokens [B], state) -> logits [B, V]``: one token per row (RNN / KV-cache form),
      updating ``state`` in place.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.layers: list[Block] = [cast(Block, b) for b in self.blocks]
        self.norm = nn.RMSNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.kv_dtype = modes.kv_cache_dtype()  # what its caches hold, bound at the load
        self.apply(self._init)
        for block in self.layers:  # GPT-2 style scaled residual projections
            for lin in (block.attn.out, block.mlp.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))
        self._fingerprint: str | None = None
        self._fused: FusedStep | None = None

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_state(self, batch: int = 1, max_context: int | None = None) -> State:
        """An empty state of ``batch`` rows (its KV caches grow as they fill, whatever
        ``max_context`` says)."""
        del max_context
        return empty_state(self.cfg, batch, self.kv_dtype)

    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, Trail]:
        """Speculative decoding's verify, step by step (:mod:`linserve.model.verify`)."""
        state.reserve(int(state.lengths.max()) + tokens.shape[1])
        return verify_by_steps(self.step, tokens, state)

    def drop_weights(self) -> None:
        """Kept: the project's models are a few MB."""

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(self.norm(x), self.embed.weight, self.embed).float()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` -> logits ``[B, T, V]`` (fp32), starting from an empty state."""
        x = self.drop(self.embed(tokens))
        for i, block in enumerate(self.layers):
            x = block(x, None, i)
        return self._head(x)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, state: State | None = None,
                all_logits: bool = False, inserts: InsertTable | None = None,
                room: int = 0) -> tuple[torch.Tensor, State]:
        """Run tokens ``[B, T]`` in the parallel form after ``state`` (None: empty).

        Returns logits ``[B, V]`` for the last position (``[B, T, V]`` with ``all_logits``) and
        a new state; the input state is not modified. For softmax, all rows must share one
        cache length. These models take text only (no ``inserts``).
        """
        if inserts:
            raise ValueError("the project's own models take text only")
        b, t = tokens.shape
        state = prefill_state(state, lambda: self.new_state(b), t, room)
        if not self.cfg.is_recurrent and bool((state.lengths != state.lengths[0]).any()):
            raise ValueError("softmax prefill needs rows of equal length")
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            x = block(x, state, i)
        state.lengths += t
        logits = self._head(x if all_logits else x[:, -1])
        return logits, state

    def set_fused_step(self, enabled: bool) -> bool:
        """Use the native fused decode step (elu+1 and softmax models; see
        :mod:`linserve.model.layers.own_step`).

        Packs the current weights, so call it after any ``.to(dtype)``. Returns whether the
        fused step is now in use: False when disabled, unsupported or not compilable here.
        """
        self._fused = None
        if enabled and own_step.supports(self) and kernels.load():
            self._fused = FusedStep(self)
        return self._fused is not None

    @property
    def uses_fused_step(self) -> bool:
        return self._fused is not None

    @property
    def fused_weights(self) -> list[torch.Tensor]:
        """The fused step's packed weights (none without it)."""
        return [] if self._fused is None else self._fused.weights

    @torch.inference_mode()
    def prefill_ragged(self, prompts: list[list[int]], states: list[State | None]
                       ) -> tuple[torch.Tensor, list[State]]:
        """Prefill several prompts of different lengths in one batched parallel pass
        (recurrent models only): rows are right-padded and the padding masked out.

        Returns each prompt's last logits ``[B, V]`` and its new single-row state; the input
        states are not modified. Equal to calling :meth:`prefill` on each prompt alone.
        """
        if not self.cfg.is_recurrent:
            raise ValueError("ragged prefill needs a recurrent (linear or favor) model")
        if not prompts or any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = pad_sequence([torch.tensor(p) for p in prompts], batch_first=True)
        # The concatenation is a copy, and concatenating recurrent states never touches the
        # inputs, so the given states need no copy of their own.
        state = State.cat([st if st is not None else self.new_state(1) for st in states])
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            x = block(x, state, i, lengths)
        state.lengths += lengths
        last = x[torch.arange(len(prompts)), lengths - 1]
        return self._head(last), state.unbatch()

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """tokens ``[B]`` -> logits ``[B, V]``; advances every row of ``state`` by one token."""
        if self._fused is not None:
            return self._fused(tokens, state)
        return self.step_eager(tokens, state)

    @torch.inference_mode()
    def step_eager(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """:meth:`step` in eager PyTorch, layer by layer: the reference the fused step is
        tested against, and the step of FAVOR+ models."""
        if not self.cfg.is_recurrent:
            state.reserve(int(state.lengths.max()) + 1)
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            x = block.step(x, state, i)
        state.lengths += 1
        return self._head(x)

    def state_nbytes(self) -> int:
        """Bytes of one session's state (for softmax: an empty cache; it grows)."""
        return self.new_state(1).nbytes

    def fingerprint(self) -> str:
        """sha256 over the config and every weight and buffer; states carry it."""
        if self._fingerprint is None:
            h = hashlib.sha256(repr(sorted(self.cfg.identity().items())).encode())
            for name, t in sorted(self.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().float().contiguous().numpy().tobytes())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def save(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (tied head stored once)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.cfg.save(directory / "config.json")
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(directory / "model.safetensors"))


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32,
               fused: bool = True, window: int | None = None) -> LanguageModel:
    """Rebuild a model from ``config.json`` and load ``model.safetensors`` (strict).

    ``fused`` loads the native kernels (built on first use): the fused decode step where the
    model supports it (see :meth:`LanguageModel.set_fused_step`) and the native sampler.
    ``window`` runs a softmax model as a sliding-window one of that many tokens (the same
    weights under a band mask; for evaluation).
    """
    directory = Path(directory)
    cfg = ModelConfig.load(directory / "config.json")
    if window is not None:
        cfg = dataclasses.replace(cfg, window=window)
    model = LanguageModel(cfg)
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    model.fingerprint()  # computed on the fp32 weights, before any cast
    model.to(dtype)
    if cfg.attention == "favor":  # random features stay exactly as saved, in fp32
        for block in model.blocks:
            block.attn.favor_w.data = block.attn.favor_w.data.float()  # type: ignore[union-attr]
    model.eval()
    if fused:
        kernels.load()  # the native sampler serves every kind of model
    model.set_fused_step(fused)
    return model


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
    state = empty_state(cfg, 1, modes.kv_cache_dtype())
    per_slot = sum(e.nbytes // e.capacity for e in state.kv_entries)
    slots = cfg.window or cfg.max_context
    return state.nbytes + per_slot * slots


def serve(model: LanguageModel, tok: Tokenizer) -> ServedModule:
    """A loaded :class:`LanguageModel` and its tokenizer, as a served model."""
    cfg = model.cfg
    empty = model.new_state(1)
    info = ModelInfo(
        architecture=cfg.kind, vocab_size=cfg.vocab_size,
        context_limit=cfg.context_limit, params=model.n_params(),
        dtype=str(model.dtype).removeprefix("torch."),
        decode_step="fused" if model.uses_fused_step else "eager",
        ragged_prefill=cfg.is_recurrent, state_bytes=empty.nbytes,
        state_grows=empty.grows, state_layout=empty.layout(),
        state_bytes_per_token=0 if not empty.grows else
        sum(e.slot_bytes for e in empty.kv_entries),
        weight_bytes=packing.resident_bytes(model, model.fused_weights),
        embedding_bytes=packing.embedding_bytes(model),
        quantization=modes.quantization(), kv_cache_dtype=empty.kv_dtype)
    return ServedModule(model, tok, None, model.fingerprint, info, chunk=cfg.chunk_size)


def load_served(path: Path, dtype: torch.dtype, fused: bool) -> ServedModule:
    """The checkpoint at ``path`` with its tokenizer, served."""
    model = load_model(path, dtype, fused=fused)
    tok = Tokenizer.from_file(path / model.cfg.tokenizer)
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens, model "
                         f"{model.cfg.vocab_size}")
    return serve(model, tok)


class OwnFamily:
    """The project's own checkpoints as a family (``registry.OWN``): loaded whole, weights
    included whatever ``weights`` says (a few MB), and checked by loading."""

    def check(self, path: Path, dtype: torch.dtype) -> None:
        """Nothing to check before the load: the load itself says what is wrong."""
        del path, dtype

    def load(self, path: Path, dtype: torch.dtype, fused: bool, weights: bool = True
             ) -> ServedModule:
        return load_served(path, dtype, fused and weights)  # described: no fused step built

    def max_state_bytes(self, path: Path) -> int:
        return max_state_bytes(path)

    def params(self, path: Path) -> int:
        """Parameters stored in the checkpoint (from its safetensors header)."""
        from linserve.model.architectures.hf import checkpoint_params

        return checkpoint_params(path)


FAMILY = OwnFamily()
