"""What every RWKV generation (4, 6, 7) shares around its two mixers: the block (a LayerNorm,
the time mix, a LayerNorm, the channel mix, each added to the residual), the LayerNorm on the
embeddings (folded into the table once loaded, as BlinkDL's reference does), the "rescale"
of checkpoints that halve the residual every few layers, and state files.

**Rescaling.** A checkpoint with ``rescale_every = R > 0`` (transformers' RWKV-4 and the
RWKV-6 Hugging Face folders, in eval mode; llama.cpp's RWKV-6 files) halves the residual
after every R-th layer and divides layer i's two output projections by 2^(i // R), so the
residual stays in fp16's range. A power of two scales exactly, so where the weights were not
divided when written (a Hugging Face folder) the block scales its two outputs instead
(``out_scale``); a GGUF file holds them divided already. Either way the model computes what
the reference computes: the LayerNorms see the halved residual (their eps is not scale-free).

**State files** (RWKV-6 and RWKV-7): a state-tuned ``.pth`` holds one ``blocks.{i}.att.
time_state`` ``[H, N, N]`` per layer in the orientation :class:`RecurrentEntry` stores S here,
value × key (v7's files as written; v5/v6 files, which RWKV-Runner transposes into its own
key × value state, hold the same value × key matrix).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model.layers.block import LayerPart
from linserve.model.layers.decoder import DecoderLM
from linserve.model.state import RecurrentEntry, State, StateError


class RwkvBlock(nn.Module):
    """``x + s·attn(attn_norm(x))``, then ``x + s·ffn(ffn_norm(x))`` with s = ``out_scale``
    (1 unless rescaling an undivided checkpoint), then halved where ``halve``; layer 0 also
    holds ``pre_norm``, the embeddings' LayerNorm, until :meth:`RwkvLM.prepare` folds it into
    the table. The time mix takes ``(x, entries, new, carry)``, the channel mix
    ``(x, entries, new)``."""

    def __init__(self, hidden: int, eps: float, attn: nn.Module, ffn: nn.Module, index: int,
                 out_scale: float = 1.0, halve: bool = False) -> None:
        super().__init__()
        if index == 0:
            self.pre_norm = nn.LayerNorm(hidden, eps=eps)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.attn = attn
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)
        self.ffn = ffn
        self.out_scale, self.halve = out_scale, halve

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        attn, ffn = cast(Any, self.attn), cast(Any, self.ffn)
        return {**attn.new_entries(batch), **ffn.new_entries(batch)}

    def native_parts(self) -> tuple[LayerPart, LayerPart]:
        """The two parts; the halving folded into the second's ``a·x + b·y`` (a power of two:
        (x + s·y) / 2 and x/2 + (s/2)·y are the same bits)."""
        half = 0.5 if self.halve else 1.0
        return (LayerPart(self.attn, self.attn_norm, b=self.out_scale),
                LayerPart(self.ffn, self.ffn_norm, a=half, b=half * self.out_scale))

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None,
                carry: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``[B, T, d]`` (or ``[B, d]`` with ``one_token``) -> the same; ``carry`` holds what
        crosses layers (RWKV-7's v₁; None: a layer run alone, as when its weights are
        packed)."""
        carry = {} if carry is None else carry
        if one_token:
            return self.forward(x.unsqueeze(1), entries, lengths, carry=carry).squeeze(1)
        a = self.attn(self.attn_norm(x), entries, new, carry)
        x = x + (a if self.out_scale == 1.0 else a * self.out_scale)
        f = self.ffn(self.ffn_norm(x), entries, new)
        x = x + (f if self.out_scale == 1.0 else f * self.out_scale)
        return x / 2 if self.halve else x


def rescaling(layers: int, rescale_every: int, divided: bool) -> list[dict[str, Any]]:
    """Each layer's ``out_scale`` and ``halve`` (see the module docstring): 2^-(i // R)
    where the checkpoint's weights were not divided already, else 1; halved after every R-th
    layer (R = 0: never)."""
    every = max(rescale_every, 0)
    return [{"out_scale": 1.0 if every == 0 or divided else 2.0 ** -(i // every),
             "halve": every > 0 and (i + 1) % every == 0} for i in range(layers)]


class RwkvLM(DecoderLM):
    """The whole model on the shared decoder body; ``carry`` passes what crosses layers."""

    def __init__(self, cfg: Any, layers: list[RwkvBlock], norm_eps: float) -> None:
        super().__init__(cfg, cfg.vocab_size, cfg.hidden_size, layers,
                         nn.LayerNorm(cfg.hidden_size, eps=norm_eps), False)

    def _run(self, x: torch.Tensor, state: State, one_token: bool = False,
             new: torch.Tensor | None = None, lengths: torch.Tensor | None = None
             ) -> torch.Tensor:
        carry: dict[str, torch.Tensor] = {}
        lengths = state.lengths if lengths is None else lengths
        for layer, entries in zip(self.model.layers, state.layers, strict=True):
            x = layer(x, entries, lengths, one_token=one_token, new=new, carry=carry)
        return x

    @torch.no_grad()
    def fold_embedding_norm(self) -> None:
        """The embeddings' LayerNorm applied to the table once, in fp32 (BlinkDL's reference
        does the same at load), then dropped."""
        first = self.model.layers[0]
        norm = getattr(first, "pre_norm", None)
        if norm is None:
            return
        table = self.model.embed_tokens.weight
        table.copy_(F.layer_norm(table.float(), (table.shape[1],), norm.weight.float(),
                                 norm.bias.float(), norm.eps).to(table.dtype))
        del first.pre_norm

    def prepare(self, fused: bool) -> bool:
        self.fold_embedding_norm()
        return super().prepare(fused)


class RwkvStateFileLM(RwkvLM):
    """An RWKV whose time mix keeps one matrix S per layer (RWKV-6, RWKV-7): its state files
    (see the module docstring) load into and are written from a state."""

    version = "RWKV"

    def state_from_file(self, tensors: dict[str, torch.Tensor], state: State) -> None:
        """A state-tuned ``.pth`` into a fresh one-row ``state`` (the token shifts stay
        zero). Raises :class:`StateError`."""
        layers = len(state.layers)
        expected = {f"blocks.{i}.att.time_state" for i in range(layers)}
        if set(tensors) != expected:
            extra = sorted(set(tensors) ^ expected)
            raise StateError(f"an {self.version} state file of {layers} layers holds "
                             f"blocks.N.att.time_state, each once (not {extra[0]})")
        for i, entries in enumerate(state.layers):
            s = cast(RecurrentEntry, entries["recurrent"]).s
            t = tensors[f"blocks.{i}.att.time_state"]
            if tuple(t.shape) != tuple(s.shape[1:]):
                raise StateError(f"blocks.{i}.att.time_state has shape {tuple(t.shape)}, the "
                                 f"model's is {tuple(s.shape[1:])}")
            s[0].copy_(t.float())

    def state_to_file(self, state: State) -> dict[str, torch.Tensor]:
        """Row 0 of ``state`` as a state file (its S per layer; RWKV-Runner's format)."""
        return {f"blocks.{i}.att.time_state": cast(RecurrentEntry, entries["recurrent"]).s[0]
                .clone() for i, entries in enumerate(state.layers)}
