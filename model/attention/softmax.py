"""Softmax attention (the baseline): rotary positions and a preallocated KV cache.

q, k, v are ``[B, H, T, D]``. The cache stores ``[B, L, H, C, D]``; a layer works on its view
``[B, H, C, D]`` and writes new keys in place at each row's own length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_tables(max_len: int, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[max_len, dim/2]`` for rotary embeddings."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]).

    x ``[B, H, T, D]``, cos/sin ``[B|1, 1, T, D/2]``.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def softmax_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_past: torch.Tensor | None, v_past: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of T new queries over ``past + new`` keys.

    q, k, v ``[B, H, T, D]``; k_past, v_past ``[B, H, P, D]`` or None. Returns ``[B, H, T, D]``.
    """
    if k_past is None or v_past is None or k_past.shape[2] == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    p, t = k_past.shape[2], q.shape[2]
    keys = torch.cat([k_past, k], dim=2)
    values = torch.cat([v_past, v], dim=2)
    mask = torch.ones(t, p + t, dtype=torch.bool, device=q.device).tril(diagonal=p)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def softmax_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
    """One decode step per row, each at its own length.

    q ``[B, H, D]``; k_cache, v_cache ``[B, H, C, D]`` already holding the new key at
    ``lengths``; lengths ``[B]``. Only the first ``max(lengths)+1`` positions are read.
    Returns ``[B, H, D]``.
    """
    span = int(lengths.max()) + 1
    keys, values = k_cache[:, :, :span], v_cache[:, :, :span]
    if bool((lengths == span - 1).all()):
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values).squeeze(2)
    mask = torch.arange(span, device=q.device)[None, :] <= lengths[:, None]  # [B, span]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                         attn_mask=mask[:, None, None, :])
    return out.squeeze(2)
