"""Lightning attention (MiniMax-Text-01's linear attention): per head a state S ``[D, D]``
with a fixed exponential decay, S_t = e^{−λ} S_{t−1} + k_tᵀ v_t and o_t = q_t S_t, where
q, k, v = silu(``qkv_proj``(x)) split per head and λ is the head's slope (``slope``: ALiBi's
rates scaled down with the layer's depth). The heads' outputs are RMS-normed together,
gated by sigmoid(``output_gate``(x)) and projected (``out_proj``).

The recurrence is Mamba2's with one group per head and dt = 1 (x = v, B = k, C = q,
A = −λ), so it runs on the Mamba2 scan (``mamba2_scan_``, natively where built): a prefill
token by token with the step's arithmetic, so prompts split anywhere give the same bits and
no T × T matrix is built. State: a :class:`~linserve.model.state.RecurrentEntry`
``s [B, H, D (v), D (k)]`` fp32, constant.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels
from linserve.model.invariant import Linear
from linserve.model.layers.norms import RMSNorm
from linserve.model.state import RecurrentEntry


def slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """Each head's decay rate λ ``[H]`` at layer ``layer`` of ``layers``, as MiniMax sets
    it: (2^{−8/H})^{h+1} · (1 − layer / (layers − 1 + 1e−5) + 1e−5)."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (layers - 1 + 1e-5) + 1e-5
    return torch.tensor([base ** (h + 1) * factor for h in range(heads)], dtype=torch.float32,
                        device="cpu")


class LightningAttention(nn.Module):
    """See the module docstring. ``[B, T, d]`` -> ``[B, T, d]``; parameter names as
    transformers': ``qkv_proj``, ``output_gate``, ``norm``, ``out_proj``."""

    split_invariant = True  # the scan is the step's arithmetic a token at a time

    def __init__(self, hidden: int, heads: int, head_dim: int, layer: int, layers: int,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.qkv_proj = Linear(hidden, 3 * width, bias=False)
        self.output_gate = Linear(hidden, width, bias=False)
        self.norm = RMSNorm(width, eps)
        self.out_proj = Linear(width, hidden, bias=False)
        self.log_rate = torch.log(slopes(heads, layer, layers))  # A_log of the Mamba2 scan

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        return {"recurrent": RecurrentEntry.empty(batch, self.heads, self.head_dim,
                                                  self.head_dim, with_z=False)}

    def _scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor,
              new: torch.Tensor | None) -> torch.Tensor:
        """q, k, v ``[B, T, H, D]`` fp32, s ``[B, H, D, D]`` (updated in place), ``new [B]``
        or None -> o ``[B, T, H, D]`` (zeros past a row's count)."""
        rows, t = q.shape[:2]
        counts = (torch.full((rows,), t, dtype=torch.long) if new is None
                  else new.to(torch.long).contiguous())
        dt = torch.ones(rows, t, self.heads)
        if kernels.available() and not torch.is_grad_enabled():
            y = torch.empty_like(v)
            torch.ops.linserve.mamba2_scan_(s, y.view(rows, t, -1), v.flatten(2), dt,
                                            self.log_rate, k.flatten(2).contiguous(),
                                            q.flatten(2).contiguous(), counts)
            return y
        decay = torch.exp(-self.log_rate.exp())[:, None, None]  # [H, 1, 1]
        y = torch.zeros_like(v)
        for i, n in enumerate(counts.tolist()):
            for j in range(n):
                s[i].mul_(decay).add_(v[i, j, :, :, None] * k[i, j, :, None, :])
                y[i, j] = invariant.sum_last(s[i] * q[i, j, :, None, :]).squeeze(-1)
        return y

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` (``new [B]``: a right-padded ragged batch's real
        counts) -> ``[B, T, d]``."""
        del lengths
        b, t, _ = x.shape
        qkv = invariant.rowwise(F.silu, self.qkv_proj.forward_fp32(x))
        q, k, v = qkv.view(b, t, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        rec: RecurrentEntry = entries["recurrent"]
        o = self._scan(q, k, v.contiguous(), rec.s, new).reshape(b, t, -1)
        o = self.norm(o.to(x.dtype))
        gate = invariant.rowwise(torch.sigmoid, self.output_gate(x))
        return self.out_proj(gate * o)

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]`` -> ``[B, d]``; the state updated in place."""
        return self.forward(x.unsqueeze(1), entries, lengths).squeeze(1)

