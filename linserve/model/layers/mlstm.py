"""xLSTM's mLSTM layer (transformers' ``xLSTMLayer``, the xLSTM-7B architecture), in RNN
mode, as transformers' native recurrent kernels compute it.

Shapes: B rows, T tokens, d = hidden, H heads, K = ``qk_dim / H``, V = ``v_dim / H``. Per
token, from the normed x:

    q, k ``[H, K]``, v ``[H, V]``, o ``[v_dim]`` = projections of x
    i, f ``[H]`` = c·tanh(W_i x / c), c·tanh(W_f x / c)      (soft caps, c = ``gate_soft_cap``)
    m' = max(logσ(f) + m, i);  a = e^{logσ(f) + m − m'};  b = e^{i − m'}
    C ← a C + b k vᵀ;  n ← a n + b k                         (per head; C ``[K, V]``)
    h = (qᵀ C / √K) / (max(|q·n| / √K, e^{−m'}) + eps)
    out = W_o (σ(o) · LayerNorm_per_head(h))

State per layer: C and n (a :class:`RecurrentEntry`, s ``[B, H, K, V]`` and z ``[B, H, K]``)
and the stabiliser m (``{"m"}``, a :class:`ConvEntry` of width 2: ``[B, 1, H]``), fp32, all
zero when fresh (as transformers starts them). Parameter names are transformers' ``single``
weight mode (``q``, ``k``, ``v``, ``ogate_preact``, ``igate_preact``, ``fgate_preact``,
``multihead_norm``, ``out_proj``); the ``fused`` mode's are split on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear
from linserve.model.layers.step_parts import MlstmPart
from linserve.model.state import ConvEntry, RecurrentEntry


@dataclass(frozen=True)
class MlstmShape:
    """One mLSTM layer's sizes and constants."""

    hidden: int
    heads: int
    qk_dim: int
    v_dim: int
    gate_soft_cap: float
    norm_eps: float
    eps: float  # the cell's, in its denominator


def mlstm_scan(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, ig: torch.Tensor, fg: torch.Tensor,
               eps: float, new: torch.Tensor | None = None) -> torch.Tensor:
    """The cell over T tokens: c ``[B, H, K, V]``, n ``[B, H, K]``, m ``[B, 1, H]`` fp32
    (advanced in place, each row by its ``new[b]`` real tokens); q, k ``[B, T, H, K]``,
    v ``[B, T, H, V]``, i, f ``[B, T, H]`` fp32 -> h ``[B, T, H, V]`` fp32. Natively where the
    kernels are built (``mlstm_scan``); the loop below is the reference."""
    if kernels.available() and not torch.is_grad_enabled():
        counts = torch.full((c.shape[0],), q.shape[1]) if new is None else new
        return torch.ops.linserve.mlstm_scan(c, n, m, *(x.contiguous() for x in (q, k, v, ig,
                                                                               fg)),
                                             counts.long().contiguous(), eps)
    h = torch.zeros(*v.shape)
    scale = q.shape[-1] ** -0.5
    for t in range(q.shape[1]):
        mt = m[:, 0]                                                   # [B, H]
        flog = F.logsigmoid(fg[:, t])
        nxt = torch.maximum(flog + mt, ig[:, t])
        a, b = torch.exp(flog + mt - nxt), torch.exp(ig[:, t] - nxt)
        kt, vt = k[:, t], v[:, t]
        c2 = a[..., None, None] * c + b[..., None, None] * (kt[..., :, None] @ vt[..., None, :])
        n2 = a[..., None] * n + b[..., None] * kt
        qs = q[:, t] * scale
        num = (qs[..., None, :] @ c2).squeeze(-2)
        qn = (qs * n2).sum(-1, keepdim=True)
        h[:, t] = num / (torch.maximum(qn.abs(), torch.exp(-nxt)[..., None]) + eps)
        live = torch.ones(c.shape[0], dtype=torch.bool) if new is None else t < new
        c.copy_(torch.where(live.view(-1, 1, 1, 1), c2, c))
        n.copy_(torch.where(live.view(-1, 1, 1), n2, n))
        m.copy_(torch.where(live.view(-1, 1, 1), nxt[:, None], m))
    return h


class MlstmLayer(nn.Module):
    """The mLSTM layer (see the module docstring)."""

    def __init__(self, sh: MlstmShape) -> None:
        super().__init__()
        d = sh.hidden
        self.shape = sh
        self.q = Linear(d, sh.qk_dim, bias=False)
        self.k = Linear(d, sh.qk_dim, bias=False)
        self.v = Linear(d, sh.v_dim, bias=False)
        self.ogate_preact = Linear(d, sh.v_dim, bias=False)
        self.igate_preact = Linear(d, sh.heads, bias=True)
        self.fgate_preact = Linear(d, sh.heads, bias=True)
        self.multihead_norm = HeadNorm(sh.heads, sh.v_dim, sh.norm_eps)
        self.out_proj = Linear(sh.v_dim, d, bias=False)

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        sh = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, sh.heads, sh.qk_dim // sh.heads,
                                                  sh.v_dim // sh.heads),
                "m": ConvEntry.empty(batch, 2, sh.heads)}

    def _projections(self) -> list[Linear]:
        return [self.q, self.k, self.v, self.ogate_preact, self.igate_preact, self.fgate_preact]

    def projection(self) -> torch.Tensor:
        """q, k, v, o, i and f as one GEMM weight ``[d, 2·qk + 2·v + 2·H]`` (each column as
        its own product would give it: :func:`packing.gemm_weight`)."""
        return packing.gemm_weight(self, *(p.weight for p in self._projections()))

    def gate_bias(self) -> torch.Tensor:
        """The input and forget gates' biases ``[2H]`` fp32."""
        return torch.cat([self.igate_preact.bias, self.fgate_preact.bias]).detach().float()

    def native_part(self) -> MlstmPart:
        sh = self.shape
        return MlstmPart(self.projection(), self.gate_bias().contiguous(),
                         self.multihead_norm.weight.detach().float().contiguous(),
                         packing.packed(self.out_proj), sh.heads, sh.qk_dim, sh.v_dim,
                         sh.gate_soft_cap, sh.norm_eps, sh.eps)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, d]`` (normed) -> ``[B, T, d]``; advances C, n and m."""
        del lengths
        sh = self.shape
        b, t, _ = x.shape
        y = invariant.project(x, self.projection()).float()
        q, k, v, o, gates = y.split([sh.qk_dim, sh.qk_dim, sh.v_dim, sh.v_dim, 2 * sh.heads], -1)
        cap = sh.gate_soft_cap
        gates = invariant.rowwise(torch.tanh, (gates + self.gate_bias()) / cap) * cap
        rec = entries["recurrent"]
        q, k, v = (z.reshape(b, t, sh.heads, -1) for z in (q, k, v))
        h = mlstm_scan(rec.s, rec.z, entries["m"].window, q, k, v,
                       gates[..., :sh.heads].contiguous(), gates[..., sh.heads:].contiguous(),
                       sh.eps, new)
        gate = invariant.rowwise(torch.sigmoid, o.contiguous())
        return self.out_proj((gate * self.multihead_norm(h)).to(x.dtype))

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        return self.forward(x.unsqueeze(1), entries, lengths).squeeze(1)


class HeadNorm(nn.Module):
    """A LayerNorm over each head's V values, then a weight over all ``[v_dim]`` (no bias):
    transformers' ``xLSTMMultiHeadLayerNorm``. ``[B, T, H, V]`` -> ``[B, T, H·V]`` fp32."""

    def __init__(self, heads: int, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.heads, self.eps = heads, eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(h.float(), (h.shape[-1],), eps=self.eps)
        return normed.flatten(-2) * self.weight.float()
