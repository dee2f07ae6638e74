"""RWKV-6 ("Finch") layers: the time mix (a linear attention with a data-dependent vector
decay and a bonus for the current token) and the channel mix, as BlinkDL's reference (the
``rwkv`` package's ``att_seq_v6_0`` / ``ffn_seq_v6``) and llama.cpp's ``rwkv6-base.cpp``
compute them.

Shapes: B rows, T tokens, d = hidden, H heads of N (d = H·N), D the token-shift LoRA's rank.
Per layer and token, with x the normed input and x₋ the previous token's:

    sx = x₋ − x;  h = tanh((x + sx·μ_x) W₁)  (5 groups of D);  m_c = h_c W₂[c]
    x_c = x + sx·(μ_c + m_c)   for c in w, k, v, r, g
    r, k, v = R x_r, K x_k, V x_v;  g = silu(G x_g)
    w = exp(−exp(w₀ + tanh(x_w D₁) D₂))                        (the decay, per channel)
    y = S r + (Σ_head r·u·k)·v;  S ← S·diag(w) + v kᵀ          (per head; u: ``time_faaaa``)
    out = O (GroupNorm_H(y)·g)

S is stored ``[B, H, N(value), N(key)]`` as RWKV-7's (:mod:`linserve.model.layers.rwkv7`);
BlinkDL's running state is the transpose, its state files this orientation. The channel mix:
``σ(R x_r) · V relu(K x_k)²`` with ``x_c = x + (x₋ − x)·μ_c``. State per layer: S, the time
mix's shift ``{"conv"}``, the channel mix's ``{"ffn"}``. Parameter names are the Hugging Face
folders' (``RWKV/v6-Finch-*-HF``: ``time_maa_*``, ``time_decay*``, ``time_faaaa``), whose
matrices keep BlinkDL's ``x @ W`` orientation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear
from linserve.model.layers.short_conv import advance_window
from linserve.model.layers.step_parts import Rwkv6TimeMixPart, RwkvGatedChannelMixPart
from linserve.model.state import ConvEntry, RecurrentEntry

GROUP_EPS = 64e-5  # the output GroupNorm's (BlinkDL's, llama.cpp's, head_size_divisor 8)
MIXES = ("w", "k", "v", "r", "g")  # the order of the token-shift LoRA's groups


@dataclass(frozen=True)
class Rwkv6Shape:
    """One RWKV-6 layer's sizes: hidden, heads of ``head_dim``, the two LoRA ranks, the
    channel mix's width."""

    hidden: int
    head_dim: int
    mix_rank: int
    decay_rank: int
    intermediate: int

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim


def f32(t: torch.Tensor) -> torch.Tensor:
    """A parameter as the native step takes it: fp32, contiguous, detached."""
    return t.detach().float().contiguous()


def wkv6_scan(s: torch.Tensor, r: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, u: torch.Tensor, new: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The recurrence over T tokens: ``s [B, H, N, N]`` fp32 (value × key; advanced in place,
    each row by its ``new[b]`` real tokens), r, w, k, v ``[B, T, H, N]`` fp32, u ``[H, N]``
    -> y ``[B, T, H, N]`` fp32. Natively where the kernels are built (``wkv6_scan``); the
    loop below is the reference."""
    if kernels.available() and not torch.is_grad_enabled():
        counts = torch.full((s.shape[0],), r.shape[1]) if new is None else new
        return torch.ops.linserve.wkv6_scan(s, *(x.contiguous() for x in (r, w, k, v)),
                                            u.float().contiguous(), counts.long().contiguous())
    y = torch.zeros_like(r)
    for t in range(r.shape[1]):
        kv = v[:, t].unsqueeze(-1) @ k[:, t].unsqueeze(-2)            # [B, H, N, N]
        y[:, t] = ((s + kv * u.unsqueeze(-2)) @ r[:, t].unsqueeze(-1)).squeeze(-1)
        nxt = s * w[:, t].unsqueeze(-2) + kv
        if new is not None:
            nxt = torch.where((t < new).view(-1, 1, 1, 1), nxt, s)
        s.copy_(nxt)
    return y


class TimeMix6(nn.Module):
    """The time mix (see the module docstring)."""

    def __init__(self, sh: Rwkv6Shape) -> None:
        super().__init__()
        d = sh.hidden
        self.shape = sh
        self.time_maa_x = nn.Parameter(torch.empty(1, 1, d))
        for name in MIXES:
            setattr(self, f"time_maa_{name}", nn.Parameter(torch.empty(1, 1, d)))
        self.time_maa_w1 = nn.Parameter(torch.empty(d, len(MIXES) * sh.mix_rank))
        self.time_maa_w2 = nn.Parameter(torch.empty(len(MIXES), sh.mix_rank, d))
        self.time_decay = nn.Parameter(torch.empty(1, 1, d))
        self.time_decay_w1 = nn.Parameter(torch.empty(d, sh.decay_rank))
        self.time_decay_w2 = nn.Parameter(torch.empty(sh.decay_rank, d))
        self.time_faaaa = nn.Parameter(torch.empty(sh.heads, sh.head_dim))
        self.receptance = Linear(d, d, bias=False)
        self.key = Linear(d, d, bias=False)
        self.value = Linear(d, d, bias=False)
        self.gate = Linear(d, d, bias=False)
        self.output = Linear(d, d, bias=False)
        self.ln_x = nn.GroupNorm(sh.heads, d, eps=GROUP_EPS)

    def new_entries(self, batch: int) -> dict[str, Any]:
        sh = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, sh.heads, sh.head_dim, sh.head_dim,
                                                  with_z=False),
                "conv": ConvEntry.empty(batch, 2, sh.hidden)}

    def native_part(self) -> Rwkv6TimeMixPart:
        """The layer as the native step takes it (the LoRAs' matrices fp32, as the eager
        form multiplies them)."""
        sh = self.shape
        maa = torch.stack([f32(getattr(self, f"time_maa_{c}")).view(-1) for c in MIXES])
        r, k, v, g, o = (packing.packed(m) for m in (self.receptance, self.key, self.value,
                                                     self.gate, self.output))
        return Rwkv6TimeMixPart(
            f32(self.time_maa_x).view(-1), maa.contiguous(), f32(self.time_maa_w1),
            f32(self.time_maa_w2), f32(self.time_decay).view(-1), f32(self.time_decay_w1),
            f32(self.time_decay_w2), f32(self.time_faaaa).view(-1), r, k, v, g, o,
            f32(self.ln_x.weight), f32(self.ln_x.bias), sh.heads, sh.head_dim, GROUP_EPS)

    def _mixed(self, x: torch.Tensor, prev: torch.Tensor) -> list[torch.Tensor]:
        """x, prev ``[B, T, d]`` -> x_w, x_k, x_v, x_r, x_g ``[B, T, d]`` fp32."""
        sx = prev - x
        b, t, _ = x.shape
        h = invariant.rowwise(torch.tanh, invariant.matmul(
            x + sx * self.time_maa_x.float().view(-1), self.time_maa_w1.float()))
        m = invariant.per_head(h.view(b, t, len(MIXES), -1), self.time_maa_w2)
        return [x + sx * (getattr(self, f"time_maa_{c}").float().view(-1) + m[..., i, :])
                for i, c in enumerate(MIXES)]

    def forward(self, x: torch.Tensor, entries: dict[str, Any], new: torch.Tensor | None,
                carry: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x [B, T, d]`` (normed) -> ``[B, T, d]``; advances S and the shift."""
        del carry
        full = advance_window(entries["conv"], x.float(), new)  # [B, 1 + T, d]
        xw, xk, xv, xr, xg = self._mixed(x.float(), full[:, :-1])
        r, k, v = (p(i.to(x.dtype)).float() for p, i in ((self.receptance, xr),
                                                          (self.key, xk), (self.value, xv)))
        g = invariant.rowwise(F.silu, self.gate(xg.to(x.dtype)).float())
        lora = invariant.matmul(invariant.rowwise(torch.tanh, invariant.matmul(
            xw, self.time_decay_w1.float())), self.time_decay_w2.float())
        w = invariant.rowwise(torch.exp, -invariant.rowwise(
            torch.exp, self.time_decay.float().view(-1) + lora))
        b, t, d = r.shape
        sh = self.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, sh.heads, sh.head_dim)

        y = wkv6_scan(entries["recurrent"].s, heads(r), heads(w), heads(k), heads(v),
                      self.time_faaaa, new).reshape(b * t, d)
        y = F.group_norm(y, sh.heads, self.ln_x.weight.float(), self.ln_x.bias.float(),
                         GROUP_EPS).view(b, t, d)
        return self.output((y * g).to(x.dtype))


class ChannelMix(nn.Module):
    """``σ(receptance(x_r)) · value(relu(key(x_k))²)``, the channel mix of RWKV-4 to 6.
    ``lerp``: how x_c is formed from x and the previous token's x₋: RWKV-6's
    ``x + (x₋ − x)·μ_c`` (``time_maa_k``, ``time_maa_r``) or RWKV-4's ``x·μ_c + x₋·(1 − μ_c)``
    (``time_mix_key``, ``time_mix_receptance``), each as its reference computes it."""

    def __init__(self, hidden: int, intermediate: int, lerp: str) -> None:
        super().__init__()
        self.lerp, self.hidden = lerp, hidden
        names = ("time_maa_k", "time_maa_r") if lerp == "maa" else (
            "time_mix_key", "time_mix_receptance")
        self.names = names
        for name in names:
            setattr(self, name, nn.Parameter(torch.empty(1, 1, hidden)))
        self.key = Linear(hidden, intermediate, bias=False)
        self.receptance = Linear(hidden, hidden, bias=False)
        self.value = Linear(intermediate, hidden, bias=False)

    def new_entries(self, batch: int) -> dict[str, Any]:
        return {"ffn": ConvEntry.empty(batch, 2, self.hidden)}

    def native_part(self) -> RwkvGatedChannelMixPart:
        mix = torch.stack([f32(getattr(self, n)).view(-1) for n in self.names]).contiguous()
        return RwkvGatedChannelMixPart(mix, packing.packed(self.key),
                                       packing.packed(self.receptance),
                                       packing.packed(self.value), self.lerp == "maa")

    def _mix(self, x: torch.Tensor, prev: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        mu = mu.float().view(-1)
        return x + (prev - x) * mu if self.lerp == "maa" else x * mu + prev * (1 - mu)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], new: torch.Tensor | None
                ) -> torch.Tensor:
        full = advance_window(entries["ffn"], x.float(), new)
        xf, prev = x.float(), full[:, :-1]
        xk, xr = (self._mix(xf, prev, getattr(self, n)).to(x.dtype) for n in self.names)
        h = torch.relu(self.key(xk).float())
        r = invariant.rowwise(torch.sigmoid, self.receptance(xr).float())
        return (r * self.value((h * h).to(x.dtype)).float()).to(x.dtype)
