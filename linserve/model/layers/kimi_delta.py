"""Kimi Delta Attention (KDA, Kimi-Linear's and Ling's linear layers): the gated delta rule
with a decay per key *channel*, not per head.

For x ``[B, T, d]``: q, k, v = silu(conv(``q_proj``, ``k_proj``, ``v_proj`` of x)) per head
(a causal depthwise conv of width K over the three); q and k L2-normalised, q scaled by
Dk^-1/2; the log-decay g = −exp(A_log_h) · softplus(``f_b_proj``(``f_a_proj``(x)) + dt_bias)
``[H, Dk]``; β = sigmoid(``b_proj``(x)) per head. Per head and token:

    S ← diag(e^g) S;  δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq

then o is RMS-normed per head, times sigmoid(``g_b_proj``(``g_a_proj``(x))), and projected
(``o_proj``). A prefill runs the step's update a token at a time (the same bits however a
prompt is split; no T × T matrix), natively where built (``kda_scan_``). State: S
``[B, H, Dk, Dv]`` and the conv window, fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels
from linserve.model.invariant import Linear
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.short_conv import advance_window, causal_conv
from linserve.model.state import ConvEntry, RecurrentEntry


@dataclass(frozen=True)
class KdaShape:
    """Model width, heads and their size (Dk = Dv), the conv width, the norm's eps.
    ``low_rank_gates``: Kimi's forget and output gates through a head-sized bottleneck
    (``f_a_proj``/``f_b_proj``, ``g_a_proj``/``g_b_proj``; else Ling's ``f_proj``,
    ``g_proj``); ``safe_lower``: Ling's safe gate, g = lower · sigmoid(e^A_log · f) in
    place of −e^A_log · softplus(f) (None: the latter)."""

    hidden: int
    heads: int
    head_dim: int
    conv_width: int
    eps: float
    low_rank_gates: bool = True
    safe_lower: float | None = None

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dimension (FLA's form, batch-invariant sum)."""
    return x / torch.sqrt(invariant.sum_last(x * x) + eps)


class KimiDeltaAttention(nn.Module):
    """See the module docstring; a mixer with the decoder's interface. Parameter names as
    transformers' (the forget gate's flattened: ``f_a_proj``, ``f_b_proj``, ``dt_bias``,
    ``A_log``; the conv kernels of q, k and v apart, as published)."""

    split_invariant = True

    def __init__(self, s: KdaShape) -> None:
        super().__init__()
        self.shape = s
        self.q_proj, self.k_proj, self.v_proj = (Linear(s.hidden, s.width, bias=False)
                                                 for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(s.width, s.width, s.conv_width, groups=s.width, bias=False)
            for _ in range(3))
        if s.low_rank_gates:
            self.f_a_proj = Linear(s.hidden, s.head_dim, bias=False)
            self.f_b_proj = Linear(s.head_dim, s.width, bias=False)
            self.g_a_proj = Linear(s.hidden, s.head_dim, bias=False)
            self.g_b_proj = Linear(s.head_dim, s.width, bias=False)
            self.A_log = nn.Parameter(torch.zeros(1, 1, s.heads, 1))
        else:
            self.f_proj = Linear(s.hidden, s.width, bias=False)
            self.g_proj = Linear(s.hidden, s.width, bias=False)
            self.A_log = nn.Parameter(torch.zeros(s.heads))
        self.dt_bias = nn.Parameter(torch.zeros(s.width))
        self.b_proj = Linear(s.hidden, s.heads, bias=False)
        self.o_norm = RMSNorm(s.head_dim, s.eps)
        self.o_proj = Linear(s.width, s.hidden, bias=False)

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        s = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, s.heads, s.head_dim, s.head_dim,
                                                  with_z=False),
                "conv": ConvEntry.empty(batch, s.conv_width, 3 * s.width)}

    def _inputs(self, x: torch.Tensor, conv: ConvEntry, new: torch.Tensor | None
                ) -> tuple[torch.Tensor, ...]:
        """x ``[B, T, d]`` -> q, k, v ``[B, T, H, D]`` (q, k normalised, q scaled), the
        decays e^g ``[B, T, H, D]`` and β ``[B, T, H]``, fp32; advances the conv window."""
        s = self.shape
        b, t, _ = x.shape
        mixed = torch.cat([p.forward_fp32(x) for p in (self.q_proj, self.k_proj,
                                                       self.v_proj)], dim=-1)
        kernel = torch.cat([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        weight = kernel.detach().float().squeeze(1).t().contiguous()
        mixed = invariant.rowwise(F.silu, causal_conv(advance_window(conv, mixed, new), weight))
        q, k, v = (y.reshape(b, t, s.heads, s.head_dim) for y in mixed.split(s.width, dim=-1))
        q = l2norm(q) * s.head_dim ** -0.5
        g = self._log_decay(x)
        beta = invariant.rowwise(torch.sigmoid, self.b_proj.forward_fp32(x))
        return q, l2norm(k), v, invariant.rowwise(torch.exp, g), beta

    def _log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, d]`` -> the log-decay g ``[B, T, H, Dk]`` fp32 (see :class:`KdaShape`)."""
        s = self.shape
        b, t, _ = x.shape
        f = (self.f_b_proj.forward_fp32(self.f_a_proj(x)) if s.low_rank_gates
             else self.f_proj.forward_fp32(x)) + self.dt_bias.float()
        f = f.view(b, t, s.heads, s.head_dim)
        rate = self.A_log.float().exp().view(s.heads, 1)
        if s.safe_lower is not None:
            return s.safe_lower * invariant.rowwise(torch.sigmoid, rate * f)
        return -rate * invariant.rowwise(F.softplus, f)

    @staticmethod
    def _token(st: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """One token's update of st ``[B, H, Dk, Dv]`` (in place): q, k, decay ``[B, H, Dk]``,
        v ``[B, H, Dv]``, β ``[B, H]`` -> o ``[B, H, Dv]``."""
        st.mul_(decay[..., None])
        memory = invariant.sum_last(st.transpose(-1, -2) * k[:, :, None, :]).squeeze(-1)
        delta = (v - memory) * beta[..., None]
        st.add_(k[..., None] * delta[:, :, None, :])
        return invariant.sum_last(st.transpose(-1, -2) * q[:, :, None, :]).squeeze(-1)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, T, H, Dv]`` -> the gated per-head norm and ``o_proj`` ``[B, T, d]``."""
        s = self.shape
        b, t = x.shape[:2]
        gate = (self.g_b_proj.forward_fp32(self.g_a_proj(x)) if s.low_rank_gates
                else self.g_proj.forward_fp32(x)).view(b, t, s.heads, -1)
        out = self.o_norm(o).float() * invariant.rowwise(torch.sigmoid, gate)
        return self.o_proj(out.reshape(b, t, -1).to(x.dtype))

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` (``new [B]``: a right-padded ragged batch's real
        counts; padding leaves the state alone) -> ``[B, T, d]``. The recurrence runs
        natively where built (``kda_scan_``, kda.h: a task per row and head, its S read and
        written once), else token by token in PyTorch (:meth:`scan_eager`, the reference)."""
        del lengths
        q, k, v, decay, beta = self._inputs(x, entries["conv"], new)
        st: torch.Tensor = entries["recurrent"].s
        if kernels.available() and not torch.is_grad_enabled() and st.is_contiguous():
            b, t = x.shape[:2]
            counts = (torch.full((b,), t, dtype=torch.long) if new is None
                      else new.to(torch.long).contiguous())
            o = torch.empty_like(v)
            torch.ops.linserve.kda_scan_(st, o, q.contiguous(), k.contiguous(), v.contiguous(),
                                         decay.contiguous(), beta.contiguous(), counts)
        else:
            o = self.scan_eager(st, q, k, v, decay, beta, new)
        return self._out(o, x)

    def scan_eager(self, st: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   decay: torch.Tensor, beta: torch.Tensor, new: torch.Tensor | None
                   ) -> torch.Tensor:
        """The recurrence token by token in PyTorch: q, k, decay ``[B, T, H, Dk]``, v
        ``[B, T, H, Dv]``, β ``[B, T, H]``, st ``[B, H, Dk, Dv]`` (updated in place) -> o
        ``[B, T, H, Dv]`` (zeros past a row's count)."""
        o = torch.zeros_like(v)
        for t in range(q.shape[1]):
            if new is None:
                o[:, t] = self._token(st, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t])
                continue
            rows = (new > t).nonzero().flatten()
            part = st[rows]
            o[rows, t] = self._token(part, q[rows, t], k[rows, t], v[rows, t], decay[rows, t],
                                     beta[rows, t])
            st[rows] = part
        return o

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]`` -> ``[B, d]``; the state updated in place."""
        return self.forward(x.unsqueeze(1), entries, lengths).squeeze(1)
