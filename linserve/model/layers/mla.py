"""Multi-head latent attention (MLA, DeepSeek-V2's; Kimi-Linear's full-attention layers,
without positions) over a *latent* cache: per token the ``kv_lora_rank`` latent c (RMS-normed)
and the ``qk_rope_head_dim`` shared key part, not every head's keys and values.

A head's key is ``[W_kb c, k_rot]`` and its value ``W_vb c`` (``kv_b_proj`` splits into W_kb,
W_vb per head). Both maps are absorbed: the query becomes ``[W_kbᵀ q_nope, q_rot]``, scored
against the latent ``[c, k_rot]`` itself (one key head for all), and the head's output is
``W_vb`` times the attention-weighted sum of the latents. The same numbers as expanding the
keys and values, in other rounding. The cache holds the latent once, as its keys (its values
are zero-wide): rank + rope floats a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from linserve.model import invariant
from linserve.model.invariant import Linear
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.rope import inv_freq, rope
from linserve.model.state import KVEntry


def interleaved_to_halves(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3), … laid out as the halves the
    rotate-half form pairs: ``[..., D]`` -> ``[x0, x2, …, x1, x3, …]``."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@dataclass(frozen=True)
class MlaShape:
    """``q_lora_rank`` 0: q projected directly; the latent norms' eps is MLA's 1e-6.
    ``rope_theta`` 0: no positions (Kimi-Linear); else DeepSeek's interleaved rotary
    positions on the rope parts (Ling). ``head_gate``: each head's output times
    sigmoid(``g_proj``(x)) (Ling)."""

    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool = False
    rope_theta: float = 0.0
    head_gate: bool = False

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


class LatentAttention(Attention):
    """MLA as an :class:`Attention` whose cache is the latent (one key head of
    ``kv_lora_rank + qk_rope_head_dim``); parameter names as transformers': ``q_proj`` or
    ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``."""

    def __init__(self, s: MlaShape) -> None:
        nn.Module.__init__(self)
        width = s.kv_lora_rank + s.rope_dim
        self.mla = s
        self.shape = AttentionShape(s.hidden, s.heads, 1, width, rotary_dim=0)
        self.freqs, self.q_scale = None, 1.0
        if s.q_lora_rank:
            self.q_a_proj = Linear(s.hidden, s.q_lora_rank, bias=s.bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(s.q_lora_rank, s.heads * s.qk_dim, bias=False)
        else:
            self.q_proj = Linear(s.hidden, s.heads * s.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(s.hidden, width, bias=s.bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, s.heads * (s.nope_dim + s.v_dim), bias=False)
        self.o_proj = Linear(s.heads * s.v_dim, s.hidden, bias=s.bias)
        if s.head_gate:
            self.g_proj = Linear(s.hidden, s.heads, bias=False)
        self.rope_freqs = inv_freq(s.rope_dim, s.rope_theta) if s.rope_theta else None
        self._maps: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_kb ``[H, nope, rank]``, W_vbᵀ ``[H, rank, v]``) fp32, cached per weight."""
        w = self.kv_b_proj.weight
        if self._maps is None or self._maps[0] != w.data_ptr():
            s = self.mla
            heads = w.detach().float().view(s.heads, s.nope_dim + s.v_dim, s.kv_lora_rank)
            self._maps = (w.data_ptr(), heads[:, : s.nope_dim].contiguous(),
                          heads[:, s.nope_dim :].transpose(1, 2).contiguous())
        return self._maps[1], self._maps[2]

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, delta: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, d]`` -> the absorbed queries ``[B, H, T, rank + rope]`` (scaled for the
        head's qk size) and the latent ``[B, 1, T, rank + rope]`` as keys and as values."""
        del delta
        s = self.mla
        b, t, _ = x.shape
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if s.q_lora_rank
             else self.q_proj(x)).float().view(b, t, s.heads, s.qk_dim)
        kb, _ = self.absorbed()
        q_rot = q[..., s.nope_dim :].transpose(1, 2)
        c, k_rot = self.kv_a_proj_with_mqa(x).float().split([s.kv_lora_rank, s.rope_dim], -1)
        k_rot = k_rot[:, None]  # [B, 1, T, rope]
        if self.rope_freqs is not None:
            q_rot, k_rot = (rope(interleaved_to_halves(y), pos, self.rope_freqs)
                            for y in (q_rot, k_rot))
        q = torch.cat([invariant.per_head(q[..., : s.nope_dim], kb).transpose(1, 2), q_rot], -1)
        # invariant.attention scales by (rank + rope)^-1/2; MLA's scale is the head's qk size's
        q = q * ((s.kv_lora_rank + s.rope_dim) ** 0.5 * s.qk_dim ** -0.5)
        latent = torch.cat([self.kv_a_layernorm(c).float()[:, None], k_rot], dim=-1)
        return q, latent, latent[..., :0]

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        """The latent cache: keys ``[B, 1, C, rank + rope]``, zero-wide values."""
        # fp32 whatever --kv-cache-dtype: the native step's latent attention reads fp32
        entry = KVEntry.empty(batch, 1, self.shape.head_dim, max_context, dtype="fp32")
        return {"kv": KVEntry(entry.k, entry.v[..., :0].contiguous(), max_context)}

    def values_of(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        del values
        return keys

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, H, T, rank + rope]`` (weighted latents) -> ``[B, T, d]``."""
        s = self.mla
        _, vb = self.absorbed()
        heads = invariant.per_head(o[..., : s.kv_lora_rank].transpose(1, 2), vb)
        if s.head_gate:
            heads = heads * invariant.rowwise(torch.sigmoid, self.g_proj.forward_fp32(x))[..., None]
        return self.o_proj(heads.reshape(*heads.shape[:2], -1).to(x.dtype))
