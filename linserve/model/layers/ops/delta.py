"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3.5's linear-attention layers):
a chunked parallel form (the WY / UT-transform form), a recurrent step, and a naive loop.

Per value head, with L2-normalised q and k ``[Dk]`` (q also scaled by Dk^-1/2), v ``[Dv]``, a
log-decay g ≤ 0 and a write strength β ∈ (0, 1), the state S ``[Dk, Dv]`` evolves as

    S ← exp(g) S                       (forget)
    δ = β (v − Sᵀk)                    (what S mispredicts for k)
    S ← S + k δᵀ                       (the delta rule: a rank-1 correction)
    o = Sᵀq

All three forms share one signature ``(q, k, v, g, beta, s) -> (out, s)``: q, k
``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, g and beta ``[B, H, T]``, s ``[B, H, Dk, Dv]``, out
``[B, H, T, Dv]``; maths and state in fp32. Query/key heads already repeated to the value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linserve.model.invariant import chunk_len, rowwise, sum_last


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt(sum_last(x * x) + eps)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One token per row, updating ``s`` in place. q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g and
    beta ``[B, H]``, s ``[B, H, Dk, Dv]``; returns out ``[B, H, Dv]``."""
    s.mul_(rowwise(torch.exp, g)[..., None, None])
    kv_mem = (k.unsqueeze(-2) @ s).squeeze(-2)  # one small matmul per (row, head): the
    delta = (v - kv_mem) * beta.unsqueeze(-1)  # same reduction order whatever the batch
    s.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ s).squeeze(-2)


def delta_rule_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, s: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: a loop over time. Shapes as the module docstring. Tests only."""
    s = s.clone()
    outs = [delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], s)
            for t in range(q.shape[2])]
    return torch.stack(outs, dim=2), s


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, s: torch.Tensor, chunk_size: int = 64
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked parallel form: inside a chunk of C tokens the C rank-1 corrections are folded
    into one triangular solve (the UT transform, (I + tril(diag(β) K Kᵀ ⊙ Γ))⁻¹), and the
    chunks hand the state on in a loop over T/C. Γ holds the in-chunk decays
    exp(Σ g) between positions. Returns out ``[B, H, T, Dv]`` and the final state."""
    b, h, t, _ = k.shape
    c = chunk_len(chunk_size, t)
    pad = (-t) % c
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # g = 0, β = 0: padding changes nothing
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [B, H, N, C]: log-decay from the chunk's start to each position
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    gamma = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * gamma  # strictly lower part used: unitriangular
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * gamma
    q_in = q * cum.exp()[..., None]
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    out = torch.empty_like(new_v)
    for i in range(n):
        u = new_v[:, :, i] - k_cum[:, :, i] @ s
        out[:, :, i] = q_in[:, :, i] @ s + attn[:, :, i] @ u
        s = s * chunk_decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ u
    return out.reshape(b, h, n * c, -1)[:, :, :t], s
