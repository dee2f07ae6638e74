"""Rotary position embeddings (the "rotate half" convention of Llama and Qwen)."""

from __future__ import annotations

import torch

from linserve.model import invariant


def inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The rotary frequencies ``[rotary_dim / 2]`` fp32."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu")  # even under meta
    return 1.0 / (theta ** (steps / rotary_dim))


def proportional_freqs(head_dim: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """Proportional RoPE's frequencies ``[head_dim / 2]`` fp32 (transformers'
    ``proportional`` type): the first ``rotary_dim / 2`` at θ^(−2i/head_dim), zeros after
    them (those pairs keep cos 1, sin 0). Applied over the whole head by :func:`rope`."""
    angles = rotary_dim // 2
    steps = torch.arange(0, 2 * angles, 2, dtype=torch.float, device="cpu")
    rotating = 1.0 / (theta ** (steps / head_dim))
    return torch.cat([rotating, torch.zeros(head_dim // 2 - angles, device="cpu")])


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor,
         axes: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary positions on the first ``2 · len(freqs)`` channels of each head (halves
    rotated; the rest pass through). x ``[B, H, T, D]``, pos ``[B, T]`` (or ``[1, T]``), or
    ``[A, B, T]`` with ``axes [rot / 2]`` saying which of the A positions each frequency
    reads (multimodal rotary positions, :mod:`linserve.model.architectures.qwen3_5.mrope`)."""
    rot = 2 * freqs.shape[0]
    if axes is not None and pos.dim() == 3:
        angles = pos.permute(1, 2, 0)[..., axes].float() * freqs  # [B, T, rot/2]
    else:
        angles = pos[..., None].float() * freqs  # [B, T, rot/2]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = (invariant.rowwise(f, emb)[:, None] for f in (torch.cos, torch.sin))
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)
