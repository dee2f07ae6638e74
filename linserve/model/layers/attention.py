"""Grouped-query attention over a KV cache: optional q/k RMSNorm per head, rotary positions
on all, part or none of each head, a custom score scale and a key multiplier. The shape of
LFM2's, Granite's, Nemotron-H's and Falcon-H1's attention layers (Qwen3.5's adds an output
gate: :mod:`linserve.model.architectures.qwen3_5`).

State: a :class:`linserve.model.state.KVEntry` ``{"kv"}`` (fp32, bf16 or int8:
``--kv-cache-dtype``), written at each row's own position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, modes, packing
from linserve.model.invariant import Linear
from linserve.model.layers.hf_keys import rope_parameters, rope_theta
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.ops.softmax import local_mask
from linserve.model.layers.rope import inv_freq, proportional_freqs, rope
from linserve.model.state import KVEntry


@dataclass(frozen=True)
class AttentionShape:
    """``rotary_dim`` 0: no positions (Nemotron-H); ``qk_norm`` False: no q/k norm;
    ``scale`` None: head_dim^-0.5; ``key_multiplier`` scales k (Falcon-H1); ``out_dim``
    None: the output is ``hidden`` wide (Zamba2's shared block reads 2·d and writes d);
    ``window`` W > 0: local attention over the last W tokens, their keys a ring of W slots
    (RecurrentGemma's, LFM3's sliding layers); ``head_gate``: each head's output times
    sigmoid(``g_proj``(x)) (LFM3); ``proportional``: "proportional" rotary positions, the
    first ``rotary_dim / 2`` of the head's D/2 pairs (i, i + D/2) rotating at θ^(−2i/D), the
    rest still."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 10_000.0
    qk_norm: bool = False
    eps: float = 1e-6
    scale: float | None = None
    key_multiplier: float = 1.0
    bias: bool = False
    out_bias: bool = False
    out_dim: int | None = None
    window: int = 0
    head_gate: bool = False
    proportional: bool = False
    qk_norm_whole: bool = False  # the q/k RMSNorm over all heads at once (OLMo's), not per head

    @classmethod
    def from_hf(cls, c: dict[str, Any], *, theta: float = 10_000.0, partial: float = 1.0,
                hidden: int | None = None, **fields: Any) -> AttentionShape:
        """The shape most families' config.json gives: ``num_attention_heads``,
        ``num_key_value_heads`` (default: as many), ``head_dim`` (default: hidden / heads),
        rotary positions on ``partial_rotary_factor`` of each head (``partial`` where the
        config has none) with base :func:`rope_theta` (``theta`` where it has none), and
        ``attention_bias`` on the projections in and out. ``hidden``: the layer's input
        width (default ``hidden_size``); ``fields``: the family's own, over these."""
        d = int(c["hidden_size"]) if hidden is None else hidden
        heads = int(c["num_attention_heads"])
        head_dim = int(fields.pop("head_dim", None) or c.get("head_dim") or d // heads)
        bias = bool(c.get("attention_bias", False))
        factor = float(rope_parameters(c).get("partial_rotary_factor", partial))
        shape = {"rotary_dim": int(head_dim * factor), "rope_theta": rope_theta(c, theta),
                 "bias": bias, "out_bias": bias, **fields}
        return cls(d, heads, int(c.get("num_key_value_heads") or heads), head_dim, **shape)


class Attention(nn.Module):
    """Causal GQA attention (see the module docstring). Parameter names: ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj`` and, with ``qk_norm``, ``q_norm``, ``k_norm``."""

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.kv_dtype = modes.kv_cache_dtype()  # what its caches hold, bound at the load
        if s.heads % s.kv_heads or s.rotary_dim % 2 or s.rotary_dim > s.head_dim:
            raise ValueError("attention heads, kv heads and rotary dimension do not fit")
        self.q_proj = Linear(s.hidden, s.heads * s.head_dim, bias=s.bias)
        self.k_proj = Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.bias)
        self.v_proj = Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.bias)
        self.o_proj = Linear(s.heads * s.head_dim, s.out_dim or s.hidden, bias=s.out_bias)
        if s.qk_norm:
            whole = s.qk_norm_whole
            self.q_norm = RMSNorm(s.head_dim * (s.heads if whole else 1), s.eps)
            self.k_norm = RMSNorm(s.head_dim * (s.kv_heads if whole else 1), s.eps)
        if s.head_gate:
            self.g_proj = Linear(s.hidden, s.heads, bias=False)
        self.freqs = (proportional_freqs(s.head_dim, s.rotary_dim, s.rope_theta) if s.proportional
                      else inv_freq(s.rotary_dim, s.rope_theta) if s.rotary_dim else None)
        # invariant.attention scales scores by head_dim^-0.5; another scale goes on q
        self.q_scale = 1.0 if s.scale is None else s.scale * s.head_dim ** 0.5

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        return {"kv": KVEntry.empty(batch, self.shape.kv_heads, self.shape.head_dim,
                                    max_context, window=self.shape.window, dtype=self.kv_dtype)}

    def qkv_weight(self) -> torch.Tensor:
        """q, k and v as one GEMM weight ``[d, (H + 2·Hkv)·D]``."""
        return packing.gemm_weight(self, self.q_proj.weight, self.k_proj.weight,
                                     self.v_proj.weight)

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, delta: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, d]`` -> q ``[B, H, T, D]``, k, v ``[B, Hkv, T, D]`` (fp32, rotated).
        ``delta [B, T, (H + 2·Hkv)·D]`` is added to the projection (Zamba2's adapters)."""
        b, t, _ = x.shape
        s = self.shape
        qkv = invariant.project(x, self.qkv_weight()).to(x.dtype)
        if self.q_proj.bias is not None:
            qkv = qkv + torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        if delta is not None:
            qkv = qkv + delta.to(qkv.dtype)
        q, k, v = qkv.float().split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                                     s.kv_heads * s.head_dim], dim=-1)
        if s.qk_norm and s.qk_norm_whole:
            q, k = self.q_norm(q).float(), self.k_norm(k).float()
        q, k, v = (y.reshape(b, t, -1, s.head_dim) for y in (q, k, v))
        if s.qk_norm and not s.qk_norm_whole:
            q, k = self.q_norm(q).float(), self.k_norm(k).float()
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        if self.freqs is not None:
            q, k = rope(q, pos, self.freqs), rope(k, pos, self.freqs)
        if s.key_multiplier != 1.0:
            k = k * s.key_multiplier
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k, v

    def values_of(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The values attention reads beside ``keys``: the cache's (MLA's latent cache
        keeps none: its keys are its values too)."""
        del keys
        return values

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, H, T, D]`` (and the layer's input x ``[B, T, d]``, for a head gate) ->
        projected ``[B, T, d]``."""
        b, _, t, _ = o.shape
        if self.shape.head_gate:
            gate = invariant.rowwise(torch.sigmoid, self.g_proj.forward_fp32(x))  # [B, T, H]
            o = o * gate.transpose(1, 2)[..., None]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1).to(x.dtype))

    def _attend(self, x: torch.Tensor, kv: KVEntry, rows: slice, start: int,
                delta: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[b, T, d]`` of ``rows`` at positions start … start+T−1."""
        t = x.shape[1]
        q, k, v = self._qkv(x, torch.arange(start, start + t)[None], delta)
        if self.shape.window:
            return self._out(self._attend_ring(q, k, v, kv, rows, start), x)
        kv.put(rows, slice(start, start + t), k, v)
        keys = kv.keys(rows, start + t)
        values = self.values_of(keys, kv.values(rows, start + t))
        return self._out(invariant.attention(q, keys, values, start), x)

    def _attend_ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVEntry,
                     rows: slice, start: int) -> torch.Tensor:
        """Local attention of T new tokens at start … start+T−1 (q ``[b, H, T, D]``, k, v
        ``[b, Hkv, T, D]``) over the ring's past keys any of them sees and their own; then the
        last min(T, W) new keys go into their slots (position mod W). -> ``[b, H, T, D]``."""
        w, t = self.shape.window, q.shape[2]
        k, v = kv.as_stored(k), kv.as_stored(v)  # as a step reads them back
        pos = torch.arange(start, start + t)
        past = torch.arange(max(0, start - w + 1), start)
        keys = torch.cat([kv.read("k", rows, past % w), k], dim=2)
        values = torch.cat([kv.read("v", rows, past % w), v], dim=2)
        if modes.active():
            o = self._ring_invariant(q, keys, values, start - len(past))
        else:
            mask = local_mask(pos, torch.cat([past, pos]), w)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        keep = pos[-w:]
        kv.put(rows, keep % w, k[:, :, -w:], v[:, :, -w:])
        return o

    def _ring_invariant(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        first: int) -> torch.Tensor:
        """:meth:`_attend_ring`'s attention, batch- and split-invariant: each query over
        exactly its window's keys, in position order, by :func:`invariant.attention` (the
        queries whose window starts at the first key, in one call). q ``[b, H, T, D]``; keys,
        values ``[b, Hkv, S, D]`` at positions first … first+S−1 -> ``[b, H, T, D]``."""
        w, t, s = self.shape.window, q.shape[2], keys.shape[2]
        start = s - t  # the first query's index among the keys
        head = max(0, min(t, w - start)) if first == 0 else 0
        outs = [invariant.attention(q[:, :, :head], keys, values, start)] if head else []
        for j in range(head, t):
            hi = start + j + 1
            outs.append(invariant.attention(q[:, :, j : j + 1], keys[:, :, hi - w : hi],
                                            values[:, :, hi - w : hi], w - 1))
        return torch.cat(outs, dim=2)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None, delta: torch.Tensor | None = None
                ) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` after ``lengths [B]`` (all equal, unless ``new [B]``
        gives a right-padded ragged batch's real counts: then each row attends alone and
        padding gives zeros) -> ``[B, T, out]``; ``delta`` as in :meth:`_qkv`."""
        kv: KVEntry = entries["kv"]
        if new is None:
            return self._attend(x, kv, slice(None), int(lengths[0]), delta)
        out = x.new_zeros(*x.shape[:2], self.o_proj.out_features)
        for i, (start, n) in enumerate(zip(lengths.tolist(), new.tolist(), strict=True)):
            part = None if delta is None else delta[i : i + 1, :n]
            out[i : i + 1, :n] = self._attend(x[i : i + 1, :n], kv, slice(i, i + 1), start,
                                              part)
        return out

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
             delta: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row ``[B, d]`` at each row's own position ``lengths [B]``;
        ``delta [B, (H + 2·Hkv)·D]`` as in :meth:`_qkv`."""
        kv: KVEntry = entries["kv"]
        q, k, v = self._qkv(x.unsqueeze(1), lengths[:, None],
                            None if delta is None else delta.unsqueeze(1))
        rows = torch.arange(x.shape[0])
        slots = lengths % self.shape.window if self.shape.window else lengths
        kv.put(rows, slots, k[:, :, 0], v[:, :, 0])
        outs = []
        for i, n in enumerate(kv.slots_used(lengths + 1).tolist()):  # each row alone
            keys = kv.keys(slice(i, i + 1), n)
            values = self.values_of(keys, kv.values(slice(i, i + 1), n))
            if self.shape.window and int(lengths[i]) + 1 > n:  # a full ring: in position order,
                order = (torch.arange(n) + int(lengths[i]) + 1) % n  # as a prefill reads them
                keys, values = keys[:, :, order], values[:, :, order]
            outs.append(invariant.attention(q[i : i + 1], keys, values, n - 1))
        return self._out(torch.cat(outs), x.unsqueeze(1)).squeeze(1)
