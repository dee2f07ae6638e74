"""Softmax attention (the baseline): rotary positions and a preallocated KV cache.

q, k, v are ``[B, H, T, D]``. The cache stores ``[B, L, H, C, D]``; a layer works on its view
``[B, H, C, D]`` and writes new keys in place at each row's own length.

The sliding-window variant (Longformer's local attention) lets a query at position i see keys
at positions (i − W, i]. Its cache is a ring of W slots: position p lives in slot p mod W.
Keys are stored already rotated, and softmax attention does not care about the order of its
keys, so the ring is read as it is, never reordered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linserve.model import modes


def rope_tables(max_len: int, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[max_len, dim/2]`` for rotary embeddings."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rope_at(pos: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*pos.shape, dim/2]`` for any positions (no table, so no length limit);
    the same fp64 angles as :func:`rope_tables`."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = pos.to(torch.float64).unsqueeze(-1) * inv
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


def local_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys each query sees: ``[Tq, Tk]`` bool, k_pos ≤ q_pos and, with a window,
    k_pos > q_pos − window. q_pos ``[Tq]``, k_pos ``[Tk]``."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


def window_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Sliding-window attention of queries at ``q_pos [T]`` over keys at ``k_pos [S]``.

    q ``[B, H, T, D]``, k, v ``[B, H, S, D]`` (past ring slots, in any order, then the new
    keys). Returns ``[B, H, T, D]``.
    """
    mask = local_mask(q_pos, k_pos, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def softmax_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 n_valid: torch.Tensor) -> torch.Tensor:
    """One decode step per row, each over its own number of cached keys.

    q ``[B, H, D]``; k_cache, v_cache ``[B, H, C, D]`` already holding the new key;
    n_valid ``[B]``: the slots each row reads, ``[0, n_valid)`` (length + 1, or for a window
    model min(length + 1, W)). Only the first ``max(n_valid)`` slots are read.
    Returns ``[B, H, D]``.
    """
    if modes.active():  # each row over its own slots alone: no shared span or batch
        return torch.cat([
            F.scaled_dot_product_attention(q[b : b + 1, :, None], k_cache[b : b + 1, :, :n],
                                           v_cache[b : b + 1, :, :n]).squeeze(2)
            for b, n in enumerate(n_valid.tolist())])
    span = int(n_valid.max())
    keys, values = k_cache[:, :, :span], v_cache[:, :, :span]
    if bool((n_valid == span).all()):
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values).squeeze(2)
    mask = torch.arange(span, device=q.device)[None, :] < n_valid[:, None]  # [B, span]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                         attn_mask=mask[:, None, None, :])
    return out.squeeze(2)
