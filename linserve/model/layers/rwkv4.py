"""RWKV-4's time mix, as transformers' ``RwkvSelfAttention`` (its CPU path,
``rwkv_linear_attention_cpu``) and BlinkDL's reference compute it.

Shapes: B rows, T tokens, d = hidden, A = the attention width. Per layer and token, with x
the normed input and x₋ the previous token's:

    x_c = x·μ_c + x₋·(1 − μ_c)   for c in k, v, r
    k, v = K x_k, V x_v;  r = σ(R x_r)
    wkv = (Σ_{i<t} e^{−(t−1−i)·e^{w₀}} e^{k_i} v_i + e^{u + k_t} v_t)
          / (the same with 1 for v)                       (per channel; w₀ = ``time_decay``)
    out = O (r·wkv)

computed with the running numerator, denominator and largest exponent p of each channel,
so no exponential overflows. The state per layer: those three ``[B, 3, 1, A]`` (a
:class:`RecurrentEntry` whose "heads" are num, den, p; a fresh state's zeros stand for
nothing seen, as the reference's p = −1e38 does), the time mix's shift ``{"conv"}`` and the
channel mix's ``{"ffn"}`` (:class:`~linserve.model.layers.rwkv6.ChannelMix`). Parameter names
are transformers' (``time_decay``, ``time_first``, ``time_mix_key``, …).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear
from linserve.model.layers.rwkv6 import f32
from linserve.model.layers.short_conv import advance_window
from linserve.model.layers.step_parts import Rwkv4TimeMixPart
from linserve.model.state import ConvEntry, RecurrentEntry


def wkv4_scan(s: torch.Tensor, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, new: torch.Tensor | None = None) -> torch.Tensor:
    """The recurrence over T tokens: ``s [B, 3, 1, A]`` fp32 (num, den, p; advanced in place,
    each row by its ``new[b]`` real tokens), w (= −exp(``time_decay``)) and u ``[A]``, k, v
    ``[B, T, A]`` fp32 -> wkv ``[B, T, A]`` fp32. Natively where the kernels are built
    (``wkv4_scan``); the loop below is the reference (transformers' CPU path)."""
    if kernels.available() and not torch.is_grad_enabled():
        counts = torch.full((s.shape[0],), k.shape[1]) if new is None else new
        return torch.ops.linserve.wkv4_scan(s, w.contiguous(), u.contiguous(), k.contiguous(),
                                            v.contiguous(), counts.long().contiguous())
    y = torch.zeros_like(k)
    num, den, p = (s[:, i, 0] for i in range(3))
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        q = torch.maximum(p, kt + u)
        e1, e2 = torch.exp(p - q), torch.exp(kt + u - q)
        y[:, t] = (e1 * num + e2 * vt) / (e1 * den + e2)
        q2 = torch.maximum(p + w, kt)
        f1, f2 = torch.exp(p + w - q2), torch.exp(kt - q2)
        nxt = torch.stack([f1 * num + f2 * vt, f1 * den + f2, q2], 1).unsqueeze(2)
        if new is not None:
            nxt = torch.where((t < new).view(-1, 1, 1, 1), nxt, s)
        s.copy_(nxt)
    return y


class TimeMix4(nn.Module):
    """The time mix (see the module docstring)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.hidden, self.width = hidden, width
        self.time_decay = nn.Parameter(torch.empty(width))
        self.time_first = nn.Parameter(torch.empty(width))
        for name in ("key", "value", "receptance"):
            setattr(self, f"time_mix_{name}", nn.Parameter(torch.empty(1, 1, hidden)))
        self.key = Linear(hidden, width, bias=False)
        self.value = Linear(hidden, width, bias=False)
        self.receptance = Linear(hidden, width, bias=False)
        self.output = Linear(width, hidden, bias=False)

    def new_entries(self, batch: int) -> dict[str, Any]:
        return {"recurrent": RecurrentEntry.empty(batch, 3, 1, self.width, with_z=False),
                "conv": ConvEntry.empty(batch, 2, self.hidden)}

    def native_part(self) -> Rwkv4TimeMixPart:
        mix = torch.stack([f32(getattr(self, f"time_mix_{n}")).view(-1)
                           for n in ("key", "value", "receptance")]).contiguous()
        return Rwkv4TimeMixPart(mix, -torch.exp(f32(self.time_decay)), f32(self.time_first),
                                *(packing.packed(m) for m in (self.key, self.value,
                                                              self.receptance, self.output)))

    def forward(self, x: torch.Tensor, entries: dict[str, Any], new: torch.Tensor | None,
                carry: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x [B, T, d]`` (normed) -> ``[B, T, d]``; advances the state and the shift."""
        del carry
        full = advance_window(entries["conv"], x.float(), new)  # [B, 1 + T, d]
        xf, prev = x.float(), full[:, :-1]

        def mixed(name: str) -> torch.Tensor:
            mu = getattr(self, f"time_mix_{name}").float().view(-1)
            return (xf * mu + prev * (1 - mu)).to(x.dtype)

        k, v = self.key(mixed("key")).float(), self.value(mixed("value")).float()
        r = invariant.rowwise(torch.sigmoid, self.receptance(mixed("receptance")).float())
        w = -torch.exp(self.time_decay.float())
        y = wkv4_scan(entries["recurrent"].s, w, self.time_first.float(), k, v, new)
        return self.output((r * y).to(x.dtype))
