"""LFM2's double-gated short convolution: ``in_proj`` to B, C and x; a causal depthwise
convolution (width L) over B·x; C times its output; ``out_proj``. State: the last L−1
inputs of the convolution, a :class:`linserve.model.state.ConvEntry` ``{"conv"}`` (constant)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels
from linserve.model.invariant import Linear
from linserve.model.state import ConvEntry


def causal_conv(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu: bool = False) -> torch.Tensor:
    """A depthwise causal convolution: ``full [B, K−1+T, C]`` (the window, then the new
    inputs) and ``weight [K, C]`` fp32 -> ``[B, T, C]`` fp32 (natively where built), plus
    ``bias [C]`` and then SiLU if asked (Mamba2's, in the same pass natively)."""
    if kernels.available() and not torch.is_grad_enabled():
        return torch.ops.linserve.causal_conv(full.float().contiguous(), weight,
                                              None if bias is None else bias.float(), silu)
    out = F.conv1d(full.float().transpose(1, 2), weight.t().unsqueeze(1),
                   groups=full.shape[2]).transpose(1, 2)
    if bias is not None:
        out = out + bias.float()
    return invariant.rowwise(F.silu, out) if silu else out


def advance_window(conv: ConvEntry, new_inputs: torch.Tensor, new: torch.Tensor | None
                   ) -> torch.Tensor:
    """The window followed by ``new_inputs [B, T, C]`` -> ``[B, K−1+T, C]`` fp32; the entry
    keeps each row's last K−1 real inputs (``new [B]``: a ragged batch's real counts),
    written in place (state entries are updated in place by every layer: a decode step runs
    on a view of the slot pool's rows)."""
    k1 = conv.window.shape[1]
    b, t, c = new_inputs.shape
    full = conv.window.new_empty(b, k1 + t, c)
    full[:, :k1] = conv.window
    full[:, k1:] = new_inputs
    ends = [t] * b if new is None else new.tolist()
    # in place: a decode step runs on a view of the slot pool's rows
    conv.window.copy_(torch.stack([full[i, n : n + k1] for i, n in enumerate(ends)]))
    return full


class ShortConv(nn.Module):
    """See the module docstring. Parameters ``in_proj``, ``conv`` (``[C, 1, L]``),
    ``out_proj``, as transformers' ``Lfm2ShortConv`` names them."""

    def __init__(self, dim: int, width: int, bias: bool = False) -> None:
        super().__init__()
        self.dim, self.width = dim, width
        self.in_proj = Linear(dim, 3 * dim, bias=bias)
        self.conv = nn.Conv1d(dim, dim, width, groups=dim, bias=bias)
        self.out_proj = Linear(dim, dim, bias=bias)
        self._w: tuple[int, torch.Tensor] | None = None

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        return {"conv": ConvEntry.empty(batch, self.width, self.dim)}

    def conv_weight(self) -> torch.Tensor:
        """The kernel as ``[L, C]`` fp32 (cached while the weight stays the same tensor)."""
        if self._w is None or self._w[0] != self.conv.weight.data_ptr():
            self._w = (self.conv.weight.data_ptr(),
                       self.conv.weight.detach().float().squeeze(1).t().contiguous())
        return self._w[1]

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, d]`` -> ``[B, T, d]``; advances the conv window."""
        del lengths
        b_gate, c_gate, xs = self.in_proj(x).chunk(3, dim=-1)
        full = advance_window(entries["conv"], (b_gate * xs).float(), new)
        y = causal_conv(full, self.conv_weight())
        if self.conv.bias is not None:
            y = y + self.conv.bias.float()
        return self.out_proj((c_gate.float() * y).to(x.dtype))

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]``."""
        return self.forward(x.unsqueeze(1), entries, lengths).squeeze(1)
