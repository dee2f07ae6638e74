"""Feed-forward blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import invariant
from model.invariant import Linear


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``; gate and up run as one GEMM. ``[..., d] -> [..., d]``."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=bias)
        self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)

    def gate_up(self) -> torch.Tensor:
        """gate and up as one GEMM weight ``[d, 2f]`` (:func:`invariant.gemm_weight`)."""
        return invariant.gemm_weight(self, self.gate_proj.weight, self.up_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = invariant.project(x, self.gate_up()).to(x.dtype).chunk(2, dim=-1)
        if self.gate_proj.bias is not None and self.up_proj.bias is not None:
            gate, up = gate + self.gate_proj.bias, up + self.up_proj.bias
        return self.down_proj(invariant.rowwise(F.silu, gate) * up)


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: ``down(relu(up(x))²)``. ``[..., d] -> [..., d]``."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())
