"""RWKV-7 ("Goose") layers: the time mix (a generalised delta rule with a vector decay) and
the channel mix (a squared-ReLU MLP over the token shift), as BlinkDL's reference (the
``rwkv`` package's ``RWKV_x070``) and llama.cpp's ``rwkv7-base.cpp`` compute them.

Shapes: B rows, T tokens, d = hidden, H heads of N (d = H·N). Per layer and token, with x the
normed input and x₋ the previous token's (the token shift):

    xx = x₋ − x;  x_c = x + xx·μ_c  for c in r, w, k, v, a, g
    r, k, v = R x_r, K x_k, V x_v
    w = exp(−e^{−1/2} σ(w₀ + tanh(x_w W₁) W₂))           (the decay, per channel)
    a = σ(a₀ + x_a A₁ A₂);  g = σ(x_g G₁) G₂
    kk = normalize(k·k_k) per head;  k ← k·(1 + (a − 1)·k_a)
    v ← v + (v₁ − v)·σ(v₀ + x_v V₁ V₂)   from layer 1 on (v₁: layer 0's v: it crosses layers)
    S ← S·diag(w) + (S·(−kk))·(kk·a)ᵀ + v kᵀ;  y = S r     (per head)
    y ← GroupNorm_H(y) + (Σ_head r·k·r_k)·v;  out = O (y·g)

S is stored ``[B, H, N(value), N(key)]``, BlinkDL's orientation (its state files' ``time_state``
for v7, and llama.cpp's); fla's is the transpose. The channel mix: ``V relu(K x_k)²`` with
``x_k = x + (x₋ − x)·μ_k``. State per layer: S (a :class:`RecurrentEntry`), the time mix's
shift ``{"conv"}`` and the channel mix's ``{"ffn"}`` (each a :class:`ConvEntry` of width 2,
``[B, 1, d]``). Parameter names follow fla-hub's ``RWKV7ForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear
from linserve.model.layers.short_conv import advance_window
from linserve.model.layers.step_parts import EMPTY, Rwkv7ChannelMixPart, Rwkv7TimeMixPart
from linserve.model.state import ConvEntry, RecurrentEntry

DECAY_SCALE = 0.606531  # e^{-1/2}: w = exp(-e^{-1/2} σ(·)) lies in (e^{-0.61}, 1)
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


@dataclass(frozen=True)
class Rwkv7Shape:
    """One RWKV-7 layer's sizes: hidden, heads of ``head_dim``, the four LoRA ranks, the
    channel mix's width, the LayerNorms' eps."""

    hidden: int
    head_dim: int
    decay_rank: int
    a_rank: int
    v_rank: int
    gate_rank: int
    intermediate: int
    norm_eps: float = 1e-5
    group_eps: float = 64e-5  # the output GroupNorm's: fla's N·norm_eps, BlinkDL's 64e-5

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim


class LoRA(nn.Module):
    """``lora.2(act(lora.0(x)))``: fla's names; ``bias`` on the second (w₀, a₀, v₀)."""

    def __init__(self, dim: int, rank: int, act: str, bias: bool) -> None:
        super().__init__()
        acts: dict[str, nn.Module] = {"tanh": nn.Tanh(), "sigmoid": nn.Sigmoid(),
                                      "none": nn.Identity()}
        self.lora = nn.Sequential(Linear(dim, rank, bias=False), acts[act],
                                  Linear(rank, dim, bias=bias))
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lora[0](x)
        if self.act != "none":
            fn = torch.tanh if self.act == "tanh" else torch.sigmoid
            h = invariant.rowwise(fn, h)
        return self.lora[2](h)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / max(‖x‖, 1e-12) over the last dim (F.normalize's), the sums batch-invariant."""
    return x / invariant.sum_last(x * x).sqrt().clamp_min(1e-12)


def wkv7_scan(s: torch.Tensor, r: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, kk: torch.Tensor, a: torch.Tensor,
              new: torch.Tensor | None = None) -> torch.Tensor:
    """The state recurrence over T tokens: ``s [B, H, N, N]`` fp32 (advanced in place, each
    row by its ``new[b]`` real tokens), r, w, k, v, kk, a ``[B, T, H, N]`` fp32 ->
    y ``[B, T, H, N]`` fp32. Natively where the kernels are built (``wkv7_scan``); the loop
    below is the reference."""
    if kernels.available() and not torch.is_grad_enabled():
        counts = torch.full((s.shape[0],), r.shape[1]) if new is None else new
        return torch.ops.linserve.wkv7_scan(s, *(x.contiguous() for x in (r, w, k, v, kk, a)),
                                            counts.long().contiguous())
    y = torch.zeros_like(r)
    for t in range(r.shape[1]):
        sa = s @ (-kk[:, t]).unsqueeze(-1)                          # [B, H, N, 1]
        nxt = s * w[:, t].unsqueeze(-2) + sa @ (kk[:, t] * a[:, t]).unsqueeze(-2) \
            + v[:, t].unsqueeze(-1) @ k[:, t].unsqueeze(-2)
        if new is not None:
            live = (t < new).view(-1, 1, 1, 1)
            nxt = torch.where(live, nxt, s)
        s.copy_(nxt)
        y[:, t] = (s @ r[:, t].unsqueeze(-1)).squeeze(-1)
    return y


class TimeMix7(nn.Module):
    """The time mix (see the module docstring). ``first``: layer 0, whose v is v₁."""

    def __init__(self, sh: Rwkv7Shape, first: bool) -> None:
        super().__init__()
        d = sh.hidden
        self.shape, self.first = sh, first
        for name in MIXES:
            setattr(self, name, nn.Parameter(torch.empty(1, 1, d)))
        self.k_k = nn.Parameter(torch.empty(d))
        self.k_a = nn.Parameter(torch.empty(d))
        self.r_k = nn.Parameter(torch.empty(sh.heads, sh.head_dim))
        self.r_proj = Linear(d, d, bias=False)
        self.k_proj = Linear(d, d, bias=False)
        self.v_proj = Linear(d, d, bias=False)
        self.o_proj = Linear(d, d, bias=False)
        self.w_lora = LoRA(d, sh.decay_rank, "tanh", bias=True)
        self.a_lora = LoRA(d, sh.a_rank, "none", bias=True)
        if not first:
            self.v_lora = LoRA(d, sh.v_rank, "none", bias=True)
        self.g_lora = LoRA(d, sh.gate_rank, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(sh.heads, d, eps=sh.group_eps)

    def new_entries(self, batch: int) -> dict[str, Any]:
        sh = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, sh.heads, sh.head_dim, sh.head_dim,
                                                  with_z=False),
                "conv": ConvEntry.empty(batch, 2, sh.hidden)}

    def _inputs(self, x: torch.Tensor, prev: torch.Tensor, carry: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, ...]:
        """x, prev ``[B, T, d]`` -> r, w (the decay), k, v, kk, a, g ``[B, T, d]`` fp32."""
        xf = x.float()
        xx = prev - xf
        xr, xw, xk, xv, xa, xg = (
            (xf + xx * getattr(self, m).float().view(-1)).to(x.dtype) for m in MIXES)
        r, k, v = (p(i).float() for p, i in ((self.r_proj, xr), (self.k_proj, xk),
                                             (self.v_proj, xv)))
        w = self.w_lora(xw).float()
        a = invariant.rowwise(torch.sigmoid, self.a_lora(xa).float())
        g = self.g_lora(xg).float()
        b, t, d = xf.shape
        sh = self.shape
        kk = l2_normalize((k * self.k_k.float()).view(b, t, sh.heads, sh.head_dim)).view(b, t, d)
        k = k * (1 + (a - 1) * self.k_a.float())
        if self.first:
            carry["v_first"] = v
        else:
            mix = invariant.rowwise(torch.sigmoid, self.v_lora(xv).float())
            v = v + (carry.get("v_first", v) - v) * mix  # (none: a layer run alone)
        decay = invariant.rowwise(torch.exp, -DECAY_SCALE * invariant.rowwise(torch.sigmoid, w))
        return r, decay, k, v, kk, a, g

    def native_part(self) -> Rwkv7TimeMixPart:
        """The layer as the native step takes it (v₁ in the plan's value slot 0)."""
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().reshape(-1).contiguous()

        def lora(m: LoRA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            up = cast(Linear, m.lora[2])
            return (packing.packed(m.lora[0]), packing.packed(up),
                    EMPTY if up.bias is None else f32(up.bias))

        v = lora(self.v_lora) if not self.first else (EMPTY, EMPTY, EMPTY)
        mixes = torch.stack([f32(getattr(self, m)) for m in MIXES]).contiguous()
        sh = self.shape
        return Rwkv7TimeMixPart(
            mixes, packing.packed(self.r_proj), packing.packed(self.k_proj),
            packing.packed(self.v_proj), packing.packed(self.o_proj), *lora(self.w_lora),
            *lora(self.a_lora), *v, *lora(self.g_lora)[:2], f32(self.k_k), f32(self.k_a),
            f32(self.r_k), f32(self.g_norm.weight), f32(self.g_norm.bias), sh.heads,
            sh.head_dim, self.first, 0, sh.group_eps)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], new: torch.Tensor | None,
                carry: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x [B, T, d]`` (normed) -> ``[B, T, d]``; advances S and the shift."""
        full = advance_window(entries["conv"], x.float(), new)  # [B, 1 + T, d]
        r, w, k, v, kk, a, g = self._inputs(x, full[:, :-1], carry)
        b, t, d = r.shape
        sh = self.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, sh.heads, sh.head_dim)

        y = wkv7_scan(entries["recurrent"].s, heads(r), heads(w), heads(k), heads(v),
                      heads(kk), heads(a), new).reshape(b * t, d)
        y = F.group_norm(y, sh.heads, self.g_norm.weight.float(), self.g_norm.bias.float(),
                         sh.group_eps).view(b, t, d)
        bonus = invariant.sum_last(heads(r * k * self.r_k.float().view(-1)))
        y = y + (bonus * heads(v)).view(b, t, d)
        return self.o_proj((y * g).to(x.dtype))


class ChannelMix7(nn.Module):
    """``value(relu(key(x + (x₋ − x)·μ_k))²)`` (fla's ``ffn``: ``x_k``, ``key``, ``value``)."""

    def __init__(self, sh: Rwkv7Shape) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.empty(sh.hidden))
        self.key = Linear(sh.hidden, sh.intermediate, bias=False)
        self.value = Linear(sh.intermediate, sh.hidden, bias=False)
        self.hidden = sh.hidden

    def new_entries(self, batch: int) -> dict[str, Any]:
        return {"ffn": ConvEntry.empty(batch, 2, self.hidden)}

    def native_part(self) -> Rwkv7ChannelMixPart:
        return Rwkv7ChannelMixPart(self.x_k.detach().float().contiguous(),
                                   packing.packed(self.key), packing.packed(self.value))

    def forward(self, x: torch.Tensor, entries: dict[str, Any], new: torch.Tensor | None
                ) -> torch.Tensor:
        full = advance_window(entries["ffn"], x.float(), new)
        xf = x.float()
        xk = (xf + (full[:, :-1] - xf) * self.x_k.float()).to(x.dtype)
        h = torch.relu(self.key(xk).float())
        return self.value((h * h).to(x.dtype))
