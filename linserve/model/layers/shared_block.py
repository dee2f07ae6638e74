"""Zamba2's layers: Mamba2 blocks, some of which ("hybrid" layers) first run a *shared*
attention-and-MLP block whose weights several layers use in turn.

A hybrid layer at hidden state x ``[B, T, d]`` with the model's input embeddings e:

- the shared block reads ``concat(x, e)`` ``[B, T, 2d]``: an RMSNorm over 2d, attention
  (heads of ``2d / heads`` channels, scores scaled by ``(head_dim / 2)^-0.5``, rotary
  positions where ``use_mem_rope``) back to d, an RMSNorm, and a GeGLU MLP — with no residual
  of its own;
- the layer's own per-layer parts: low-rank adapters (``B·A``, as LoRA) added to the shared
  q, k, v and gate-up projections, and a ``linear`` d×d on the block's output t;
- then the Mamba2 block: ``x + mamba(norm(x + linear(t)))``.

The shared blocks are held once, in the model (:class:`SharedBlockLM`); each hybrid layer
keeps its own KV cache for its use of the block. A plain Mamba2 layer is
``x + mamba(norm(x))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from linserve.model.invariant import Linear
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba2 import Mamba2, Mamba2Shape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm
from linserve.model.state import State


def low_rank(dim_in: int, rank: int, dim_out: int) -> nn.Sequential:
    """An adapter ``[..., in] -> [..., out]`` through ``rank`` (checkpoint names ``0``, ``1``)."""
    return nn.Sequential(Linear(dim_in, rank, bias=False), Linear(rank, dim_out, bias=False))


class Adapters(nn.Module):
    """One hybrid layer's adapters on the shared block: ``gate_up`` always, and ``q``, ``k``,
    ``v`` where the checkpoint has attention adapters (``rank`` 0: none)."""

    def __init__(self, attn: AttentionShape, hidden: int, ff: int, rank: int,
                 attention_rank: int) -> None:
        super().__init__()
        self.gate_up = low_rank(hidden, rank, 2 * ff)
        self.attention = attention_rank > 0
        if self.attention:
            width = attn.heads * attn.head_dim
            self.q = low_rank(attn.hidden, attention_rank, width)
            self.k = low_rank(attn.hidden, attention_rank, width)
            self.v = low_rank(attn.hidden, attention_rank, width)

    def qkv(self, h: torch.Tensor) -> torch.Tensor | None:
        """The q, k, v additions for normed input h ``[..., 2d]`` (None: no adapters)."""
        if not self.attention:
            return None
        return torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1)


class SharedBlock(nn.Module):
    """The shared attention-and-MLP block (names as Zamba2's ``shared_transformer``):
    ``input_layernorm`` (2d), ``self_attn``, ``pre_ff_layernorm`` (d), ``feed_forward``."""

    def __init__(self, attn: AttentionShape, hidden: int, ff: int, eps: float, act: str
                 ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(attn.hidden, eps)
        self.self_attn = Attention(attn)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = SwiGLU(hidden, ff, fused=True, act=act)

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, entries: dict[str, Any],
                lengths: torch.Tensor, adapters: Adapters, one_token: bool,
                new: torch.Tensor | None) -> torch.Tensor:
        """x and embeddings ``[B, d]`` (``one_token``) or ``[B, T, d]`` -> the same shape;
        writes this use's keys and values into ``entries["kv"]``."""
        h = self.input_layernorm(torch.cat([x, embeddings], dim=-1))
        delta = adapters.qkv(h)
        if one_token:
            a = self.self_attn.step(h, entries, lengths, delta)
        else:
            a = self.self_attn(h, entries, lengths, new, delta)
        a = self.pre_ff_layernorm(a)
        return self.feed_forward(a, adapters.gate_up(a))


class MambaLayer(nn.Module):
    """``x + mixer(input_layernorm(x + linear(t)))``, t the shared block's output on a hybrid
    layer (``block`` its index in the model's shared blocks; None: a plain Mamba2 layer)."""

    def __init__(self, mamba: Mamba2Shape, eps: float, block: int | None = None,
                 adapters: Adapters | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(mamba.hidden, eps)
        self.mixer = Mamba2(mamba)
        self.block = block
        if block is not None:
            assert adapters is not None
            self.linear = Linear(mamba.hidden, mamba.hidden, bias=False)
            self.adapters = adapters
        self.shared: tuple[SharedBlock, ...] = ()  # set by SharedBlockLM (not a submodule)

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        entries = self.mixer.new_entries(batch, max_context)
        if self.block is not None:
            entries |= self.shared[0].self_attn.new_entries(batch, max_context)
        return entries

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None,
                embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """As a :class:`~linserve.model.layers.block.Block`, with the model's input
        ``embeddings`` (None: x itself, as when packing one layer's weights alone)."""
        h = x
        if self.block is not None:
            t = self.shared[0](x, x if embeddings is None else embeddings, entries, lengths,
                               self.adapters, one_token, new)
            h = x + self.linear(t)
        h = self.input_layernorm(h)
        h = self.mixer.step(h, entries, lengths) if one_token else \
            self.mixer(h, entries, lengths, new)
        return x + h


class SharedBlockLM(DecoderLM):
    """A :class:`DecoderLM` of :class:`MambaLayer` s and the shared blocks they use in turn
    (``model.shared_blocks``, held once); each layer is given the input embeddings."""

    def __init__(self, cfg: Any, vocab: int, dim: int, layers: Sequence[MambaLayer],
                 shared: Sequence[SharedBlock], norm: nn.Module, tie: bool) -> None:
        super().__init__(cfg, vocab, dim, layers, norm, tie)
        self.model.shared_blocks = nn.ModuleList(shared)
        for layer in layers:
            if layer.block is not None:
                layer.shared = (shared[layer.block],)

    def _run(self, x: torch.Tensor, state: State, one_token: bool = False,
             new: torch.Tensor | None = None, lengths: torch.Tensor | None = None
             ) -> torch.Tensor:
        lengths = state.lengths if lengths is None else lengths
        embeddings = x
        for layer, entries in zip(self.model.layers, state.layers, strict=True):
            x = layer(x, entries, lengths, one_token=one_token, new=new, embeddings=embeddings)
        return x
