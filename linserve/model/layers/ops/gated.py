"""Gated causal linear attention: the (s, z) recurrence with a data-dependent forget gate.

s_t = g_t ⊙ s_{t-1} + φ(k_t) v_tᵀ and z_t = g_t ⊙ z_{t-1} + φ(k_t), where the gate
g_t ``[F]`` (per head) scales the rows of s and the entries of z, as in GLA (Yang et al.
2023) and Random Feature Attention's gate. The output is unchanged in form:
φ(q_t)ᵀ s_t / (φ(q_t)ᵀ z_t + eps). Gates arrive as log-gates ``lg = log g`` in [LOG_GATE_MIN, 0].

Shapes as in :mod:`linserve.model.layers.ops.linear`: fq, fk ``[B, H, T, F]``, v ``[B, H, T, M]``,
lg ``[B, H, T, F]``, s ``[B, H, F, M]``, z ``[B, H, F]``; state and maths in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linserve.model.invariant import chunk_len
from linserve.model.layers.ops.linear import causal_linear_step

# The gate is at least e^-1 per token, so within a chunk of C tokens the cumulative decay is
# at least e^-C: with C ≤ 64 its inverse, e^64 ≈ 6e27, stays far inside fp32's range. The
# backward pass divides by the decay twice (d(k/D)/dD = -k/D²: e^128 overflows fp32 to inf,
# and inf·0 is NaN), so training uses chunks of at most 16 (e^32 ≈ 8e13).
LOG_GATE_MIN = -1.0
GATE_TEMPERATURE = 16.0
MAX_CHUNK = 64
MAX_CHUNK_GRAD = 16


def log_gate(logits: torch.Tensor) -> torch.Tensor:
    """GLA's gate: log g = logsigmoid(logits) / 16, clamped to [LOG_GATE_MIN, 0]. Any shape."""
    return (F.logsigmoid(logits.float()) / GATE_TEMPERATURE).clamp(min=LOG_GATE_MIN)


def gated_linear_parallel(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    lg: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    chunk_size: int = 64,
    eps: float = 1e-6,
    normalise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked parallel form with the decay inside chunks, in fp32 (autocast off).

    Within a chunk, b_t = Σ_{i≤t} lg_i (cumulative from the chunk's start), so the decay from
    key j to query t is exp(b_t − b_j) = exp(b_t)/exp(b_j): queries scaled by exp(b_t) and
    keys divided by exp(b_j) give the intra-chunk scores with one matmul (one exp in all).
    Chunks then hand the state on in a loop over T/C chunks. Returns out ``[B, H, T, M]`` and
    the final (s, z). ``normalise=False`` returns the numerator φ(q)ᵀs alone.
    """
    with torch.autocast("cpu", enabled=False):
        fq, fk, v, lg = fq.float(), fk.float(), v.float(), lg.float()
        b, h, t, f = fq.shape
        m = v.shape[-1]
        limit = MAX_CHUNK_GRAD if torch.is_grad_enabled() and lg.requires_grad else MAX_CHUNK
        c = chunk_len(min(chunk_size, limit), t)
        pad = (-t) % c
        if pad:  # zero keys add nothing; a zero log-gate keeps the state; padded outputs drop
            fq, fk, v, lg = (F.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v, lg))
        n = (t + pad) // c
        qc, kc, gc = (x.reshape(b, h, n, c, f) for x in (fq, fk, lg))
        vc = v.reshape(b, h, n, c, m)
        decay_in = gc.cumsum(-2).exp()  # [B, H, N, C, F]: decay from the chunk's start
        q_in = qc * decay_in
        k_in = kc / decay_in
        decay = decay_in[..., -1, :]  # [B, H, N, F]: the whole chunk's decay
        k_out = k_in * decay.unsqueeze(-2)  # decay from each key to the chunk's end
        mask = torch.ones(c, c, dtype=torch.bool, device=fq.device).tril()
        scores = (q_in @ k_in.transpose(-1, -2)).masked_fill(~mask, 0.0)  # [B, H, N, C, C]
        kv = k_out.transpose(-1, -2) @ vc  # [B, H, N, F, M]
        ksum = k_out.sum(-2)  # [B, H, N, F]
        s_starts, z_starts = [], []
        for i in range(n):
            s_starts.append(s)
            z_starts.append(z)
            s = decay[:, :, i, :, None] * s + kv[:, :, i]
            z = decay[:, :, i] * z + ksum[:, :, i]
        s_prefix = torch.stack(s_starts, dim=2)  # [B, H, N, F, M]: state before each chunk
        z_prefix = torch.stack(z_starts, dim=2)
        num = scores @ vc + q_in @ s_prefix
        if normalise:
            den = scores.sum(-1) + (q_in * z_prefix.unsqueeze(-2)).sum(-1)
            num = num / (den.unsqueeze(-1) + eps)
        out = num.reshape(b, h, n * c, m)[:, :, :t]
        return out, s, z


def gated_linear_step(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    lg: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    eps: float = 1e-6,
    normalise: bool = True,
) -> torch.Tensor:
    """One recurrent step, updating ``s`` and ``z`` in place.

    fq, fk, lg ``[B, H, F]``, v ``[B, H, M]``, s ``[B, H, F, M]``, z ``[B, H, F]``.
    Returns out ``[B, H, M]`` (the numerator alone with ``normalise=False``).
    """
    g = lg.exp()
    s.mul_(g.unsqueeze(-1))  # forget first, then the ungated update and readout
    z.mul_(g)
    return causal_linear_step(fq, fk, v, s, z, eps, normalise)


def gated_linear_naive(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    lg: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    eps: float = 1e-6,
    normalise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: a Python loop over time. Shapes as :func:`gated_linear_parallel`. Tests only."""
    s, z = s.clone(), z.clone()
    outs = [gated_linear_step(fq[:, :, i], fk[:, :, i], v[:, :, i], lg[:, :, i], s, z, eps,
                              normalise)
            for i in range(fq.shape[2])]
    return torch.stack(outs, dim=2), s, z
