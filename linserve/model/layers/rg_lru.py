"""Griffin's recurrent block (RecurrentGemma's ``RecurrentGemmaRecurrentBlock``), with the
Real-Gated Linear Recurrent Unit (RG-LRU) at its heart.

For x ``[B, T, d]``: ``y = gelu_tanh(linear_y(x))``; ``u = conv(linear_x(x))`` (a causal
depthwise convolution with bias, no activation); ``h = rg_lru(u)``; ``linear_out(h · y)``.

The RG-LRU, per channel c of the width L, with per-head block-diagonal gates (H blocks of
L/H channels):

- input gate ``i = σ(u W_in + b_in)``, recurrence gate ``r = σ(u W_rec + b_rec)``;
- log-decay ``log a = −8 · r · softplus(Λ)`` (Λ: ``recurrent_param``);
- ``h_t = a_t · h_{t−1} + √(1 − a_t²) · (i_t · u_t)``, where at position 0 the state is
  reset and the input is not scaled (``√(1 − a²)`` becomes 1);
- the output at t is ``h_t`` itself.

State: the conv window ``[B, K−1, L]`` and h as a :class:`~linserve.model.state.RecurrentEntry`
``s [B, 1, 1, L]``, both fp32 and constant in size. A prefill runs the recurrence a token at
a time, the step's arithmetic; a ragged batch's padding leaves a row's state as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant
from linserve.model.invariant import Linear
from linserve.model.layers.mlp import ACTIVATIONS
from linserve.model.layers.short_conv import advance_window, causal_conv
from linserve.model.state import ConvEntry, RecurrentEntry


@dataclass(frozen=True)
class RecurrentShape:
    """``width``: the LRU width L (``lru_width``); ``heads``: its gate blocks."""

    hidden: int
    width: int
    heads: int
    conv_width: int
    act: str = "gelu_pytorch_tanh"


class RGLRU(nn.Module):
    """The recurrence (parameter names as transformers': ``recurrent_param [L]``,
    ``input_gate_weight`` / ``recurrent_gate_weight [H, L/H, L/H]`` and their biases
    ``[H, L/H]``)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        block = width // heads
        self.heads = heads
        self.recurrent_param = nn.Parameter(torch.zeros(width))
        self.input_gate_weight = nn.Parameter(torch.zeros(heads, block, block))
        self.input_gate_bias = nn.Parameter(torch.zeros(heads, block))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(heads, block, block))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(heads, block))

    def _gates(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u ``[B, T, L]`` fp32 -> the input and recurrence gates ``[B, T, L]`` (each head's
        block its own product; batch-invariant when the mode is on)."""
        b, t, width = u.shape
        blocks = u.reshape(b, t, self.heads, -1)
        out = []
        for weight, bias in ((self.input_gate_weight, self.input_gate_bias),
                             (self.recurrent_gate_weight, self.recurrent_gate_bias)):
            g = invariant.per_head(blocks, weight) + bias.float()
            out.append(invariant.rowwise(torch.sigmoid, g.reshape(b, t, width)))
        return out[0], out[1]

    def forward(self, u: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                real: torch.Tensor | None) -> torch.Tensor:
        """u ``[B, T, L]`` fp32 at ``positions [B, T]``; h ``[B, L]`` (updated in place);
        ``real [B, T]`` bool (None: all) marks the tokens that are not padding. -> the
        states ``[B, T, L]``."""
        gate_in, gate_rec = self._gates(u)
        log_a = -8.0 * gate_rec * invariant.rowwise(F.softplus, self.recurrent_param.float())
        a = invariant.rowwise(torch.exp, log_a)
        scale = invariant.rowwise(torch.sqrt, 1.0 - invariant.rowwise(torch.exp, 2.0 * log_a))
        first = (positions == 0)[..., None]
        x = u * gate_in * torch.where(first, torch.ones_like(scale), scale)
        a = torch.where(first, torch.zeros_like(a), a)
        if real is not None:  # padding: keep the state (a = 1, no input)
            a = torch.where(real[..., None], a, torch.ones_like(a))
            x = x * real[..., None]
        out = torch.empty_like(u)
        for t in range(u.shape[1]):
            h.mul_(a[:, t]).add_(x[:, t])
            out[:, t] = h
        return out


class RecurrentBlock(nn.Module):
    """Griffin's recurrent block (see the module docstring): ``linear_y``, ``linear_x``,
    ``conv_1d``, ``rg_lru``, ``linear_out``, as transformers names them; a mixer with the
    decoder's interface."""

    split_invariant = False  # the recurrence is bit-stable, its GEMMs' splits within fp32

    def __init__(self, shape: RecurrentShape) -> None:
        super().__init__()
        s = self.shape = shape
        self.linear_y = Linear(s.hidden, s.width)
        self.linear_x = Linear(s.hidden, s.width)
        self.linear_out = Linear(s.width, s.hidden)
        self.conv_1d = nn.Conv1d(s.width, s.width, s.conv_width, groups=s.width)
        self.rg_lru = RGLRU(s.width, s.heads)
        self._act = ACTIVATIONS[s.act]

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        s = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, 1, 1, s.width, with_z=False),
                "conv": ConvEntry.empty(batch, s.conv_width, s.width)}

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` after ``lengths [B]`` (``new [B]``: a right-padded
        ragged batch's real counts) -> ``[B, T, d]``."""
        t = x.shape[1]
        y = invariant.rowwise(self._act, self.linear_y.forward_fp32(x))
        weight = self.conv_1d.weight.detach().float().squeeze(1).t().contiguous()
        u = causal_conv(advance_window(entries["conv"], self.linear_x.forward_fp32(x), new),
                        weight, self.conv_1d.bias)
        steps = torch.arange(t)[None, :]
        real = None if new is None else steps < new[:, None]
        rec: RecurrentEntry = entries["recurrent"]
        h = self.rg_lru(u, rec.s[:, 0, 0], lengths[:, None] + steps, real)  # a view: in place
        return self.linear_out(h.mul_(y).to(x.dtype))

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]`` at each row's own position -> ``[B, d]``."""
        return self.forward(x.unsqueeze(1), entries, lengths).squeeze(1)
