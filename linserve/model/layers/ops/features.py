"""Feature maps φ for linear attention: elu+1 and FAVOR+ positive orthogonal random features."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linserve.model import invariant


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1, elementwise; any shape ``[..., D] -> [..., D]``."""
    return F.elu(x) + 1.0


def draw_orthogonal_features(m: int, d: int, seed: int) -> torch.Tensor:
    """Draw the FAVOR+ projection ``W [m, d]``: blocks of orthogonal rows, each row rescaled to
    the norm of a Gaussian vector (chi-distributed), so that E[w wᵀ] = I. Drawn once, saved with
    the weights, never redrawn at inference."""
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=gen, dtype=torch.float64)
        q, _ = torch.linalg.qr(g)
        blocks.append(q.T)
    w = torch.cat(blocks, dim=0)[:m]
    norms = torch.randn(m, d, generator=gen, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (w * norms).to(torch.float32)


def favor_raw_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Unstabilised positive random features, so that E[φ(q)·φ(k)] = exp(q·k/√d).

    x ``[..., d]``, w ``[m, d]`` -> ``[..., m]``. Used by tests; the model uses
    :func:`favor_features`, which is the same up to factors that cancel in the attention ratio.
    """
    d = x.shape[-1]
    xs = x * d**-0.25
    proj = xs @ w.T
    return torch.exp(proj - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(w.shape[0])


def favor_features(x: torch.Tensor, w: torch.Tensor, is_query: bool) -> torch.Tensor:
    """Stabilised FAVOR+ features ``[..., d] -> [..., m]`` that never look at other positions.

    Completing the square, wᵢ·x − |x|²/2 ≤ |wᵢ|²/2, so keys use the fixed per-feature offset
    |wᵢ|²/2 and are bounded by 1. Queries get the opposite offset (so each product
    φ(q)ᵢφ(k)ᵢ is unchanged) and subtract their own row maximum, a per-query scalar that cancels
    between numerator and denominator. Nothing depends on any other token, unlike the
    reference code's key maximum over the whole sequence, which leaks the future.
    """
    d = x.shape[-1]
    xs = x * d**-0.25
    half_w2 = 0.5 * (w * w).sum(-1)  # [m]
    proj = invariant.matmul(xs, w.T) - 0.5 * (xs * xs).sum(-1, keepdim=True)
    if is_query:
        proj = proj + half_w2
        proj = proj - proj.amax(dim=-1, keepdim=True).detach()
    else:
        proj = proj - half_w2
    return torch.exp(proj)
