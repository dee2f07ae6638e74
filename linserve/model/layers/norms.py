"""Normalisations, computed in fp32 whatever the weights' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dimension, fp32 (batch-invariant sum)."""
    xf = x.float()
    return xf * torch.rsqrt(invariant.sum_last(xf * xf) / x.shape[-1] + eps)


class RMSNorm(nn.Module):
    """``w · x / rms(x)`` (LFM2, Granite, Nemotron-H, Falcon-H1, Llama). ``offset`` 1 gives
    Qwen's form, whose weight is stored as w − 1 (it scales by 1 + w). Returns x's dtype."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def scale(self) -> torch.Tensor:
        """The factor applied after normalising, ``[dim]`` fp32."""
        return self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return (rms(x, self.eps) * self.scale()).to(x.dtype)
        # as transformers' Llama-style norm: normalise in fp32, cast, then scale
        return self.weight * rms(x, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm: ``y · silu(z)`` normalised over groups of ``dim / groups``
    channels, times w. ``norm_before_gate``: normalise y first, then gate (Falcon-H1's
    option); the default gates first, as Mamba2 does. x, z ``[..., dim]`` -> fp32."""

    def __init__(self, dim: int, eps: float, groups: int = 1,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.groups, self.norm_before_gate = eps, groups, norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = x.float()
        gate = invariant.rowwise(F.silu, z.float())
        if not self.norm_before_gate:
            x = x * gate
        shape = x.shape
        x = rms(x.reshape(*shape[:-1], self.groups, -1), self.eps).reshape(shape)
        if self.norm_before_gate:
            x = x * gate
        return self.weight.float() * x
