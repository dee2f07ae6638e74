"""Causal linear attention: chunked parallel form, recurrent step, and a naive reference.

All three share one signature, ``(fq, fk, v, s, z, ...) -> (out, s, z)``:
fq, fk ``[B, H, T, F]`` are feature-mapped queries/keys, v ``[B, H, T, M]``,
s ``[B, H, F, M]`` = Σ φ(k)vᵀ and z ``[B, H, F]`` = Σ φ(k) carry the prefix in fp32.
out ``[B, H, T, M]`` = φ(q)ᵀs / (φ(q)ᵀz + eps), including the current token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linserve.model.invariant import chunk_len


def causal_linear_parallel(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked parallel form: O(T·C) memory, never a T×T matrix.

    Within a chunk of C tokens the causal C×C scores are explicit; across chunks the exclusive
    prefix sums of φ(k)vᵀ carry the past. Returns out ``[B, H, T, M]`` and the final (s, z).
    """
    b, h, t, f = fq.shape
    m = v.shape[-1]
    c = chunk_len(chunk_size, t)
    pad = (-t) % c
    if pad:  # zero keys/values add nothing to sums; padded queries are dropped at the end
        fq, fk, v = (F.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v))
    n = (t + pad) // c
    qc = fq.reshape(b, h, n, c, f)
    kc = fk.reshape(b, h, n, c, f)
    vc = v.reshape(b, h, n, c, m)
    kv = kc.transpose(-1, -2) @ vc  # [B, H, N, F, M]
    ksum = kc.sum(-2)  # [B, H, N, F]
    # State before each chunk: an exclusive prefix sum (never cumsum - kv, whose rounding
    # would leak a chunk's own future tokens into its earlier positions), summed chunk by
    # chunk: torch.cumsum along this middle dimension was 20x slower than N adds.
    s_prefix = exclusive_prefix(s, kv)
    z_prefix = exclusive_prefix(z, ksum)
    mask = torch.ones(c, c, dtype=torch.bool, device=fq.device).tril()
    scores = (qc @ kc.transpose(-1, -2)).masked_fill(~mask, 0.0)  # [B, H, N, C, C]
    num = scores @ vc + qc @ s_prefix
    den = scores.sum(-1) + (qc * z_prefix.unsqueeze(-2)).sum(-1)
    out = num / (den.unsqueeze(-1) + eps)
    out = out.reshape(b, h, n * c, m)[:, :, :t]
    return out, s_prefix[:, :, -1] + kv[:, :, -1], z_prefix[:, :, -1] + ksum[:, :, -1]


def exclusive_prefix(start: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """``[start, start + p0, start + p0 + p1, ...]`` stacked on dim 2: start ``[B, H, *S]``,
    parts ``[B, H, N, *S]`` -> ``[B, H, N, *S]``, the sum before each of the N parts."""
    acc, out = start, [start]
    for i in range(parts.shape[2] - 1):
        acc = acc + parts[:, :, i]
        out.append(acc)
    return torch.stack(out, dim=2)


def causal_linear_step(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    eps: float = 1e-6,
    normalise: bool = True,
) -> torch.Tensor:
    """One recurrent step, updating ``s`` and ``z`` in place.

    fq, fk ``[B, H, F]``, v ``[B, H, M]``, s ``[B, H, F, M]`` and z ``[B, H, F]`` (views into a
    batched state are fine). Returns out ``[B, H, M]``; ``normalise=False`` returns the
    numerator φ(q)ᵀs alone (the output-norm ablation normalises it elsewhere).
    """
    s.addcmul_(fk.unsqueeze(-1), v.unsqueeze(-2))
    z.add_(fk)
    num = (fq.unsqueeze(-2) @ s).squeeze(-2)
    if not normalise:
        return num
    den = (fq * z).sum(-1, keepdim=True)
    return num / (den + eps)


def causal_linear_naive(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: a Python loop over time. Shapes as :func:`causal_linear_parallel`. Tests only."""
    s, z = s.clone(), z.clone()
    outs = []
    for i in range(fq.shape[2]):
        outs.append(causal_linear_step(fq[:, :, i], fk[:, :, i], v[:, :, i], s, z, eps))
    return torch.stack(outs, dim=2), s, z
