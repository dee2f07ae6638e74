"""The Mamba-1 mixer (Mamba, Falcon-Mamba, Jamba's Mamba layers), as transformers' slow path
computes it: ``in_proj`` to x and z; a causal depthwise convolution and SiLU over x;
``x_proj`` to the time step's low-rank input (``time_step_rank``), B and C (Falcon-Mamba
normalises the three, without weights, ``mixer_rms_eps``; Jamba with weights); dt =
softplus(``dt_proj``(…)), its bias added after the product; the selective scan; the D skip; y ·
silu(z); ``out_proj``.

Unlike Mamba2 the decay is per channel *and* state: A = −exp(A_log) ``[inner, N]``, so per
channel i the state s_i ``[N]`` takes s_i ← exp(dt_i A_i) ⊙ s_i + dt_i x_i B, and
y_i = s_i · C + D_i x_i. A prefill runs the recurrence a token at a time (the step's
arithmetic, so a prompt's split does not change a row's result), natively where built
(``mamba1_scan_``, ``kernels/mamba1.h``) and in ATen otherwise, the two tested equal within
fp32 rounding; each row's padded tokens get dt = 0 (no decay, no write). State: a
:class:`linserve.model.state.RecurrentEntry` ``s [B, inner, 1, N]`` and the conv window
``[B, K−1, inner]``, fp32, constant in size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels
from linserve.model.invariant import Linear
from linserve.model.layers.norms import RMSNorm, rms
from linserve.model.layers.short_conv import advance_window, causal_conv
from linserve.model.state import ConvEntry, RecurrentEntry


@dataclass(frozen=True)
class Mamba1Shape:
    """``inner``: the expanded width; ``dt_rank``: ``time_step_rank``; ``bcdt_eps``: RMS
    norms on dt, B and C (None: none), weightless (Falcon-Mamba) or, with ``bcdt_weights``,
    with weights (Jamba's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``)."""

    hidden: int
    inner: int
    d_state: int
    dt_rank: int
    conv_width: int
    conv_bias: bool = True
    proj_bias: bool = False
    bcdt_eps: float | None = None
    bcdt_weights: bool = False


class Mamba1(nn.Module):
    """See the module docstring. Parameters ``in_proj``, ``conv1d``, ``x_proj``,
    ``dt_proj``, ``A_log``, ``D``, ``out_proj``, as transformers names them."""

    split_invariant = False  # the recurrence is bit-stable, its GEMMs' splits within fp32

    def __init__(self, shape: Mamba1Shape) -> None:
        super().__init__()
        s = self.shape = shape
        self.in_proj = Linear(s.hidden, 2 * s.inner, bias=s.proj_bias)
        self.conv1d = nn.Conv1d(s.inner, s.inner, s.conv_width, groups=s.inner,
                                bias=s.conv_bias)
        self.x_proj = Linear(s.inner, s.dt_rank + 2 * s.d_state, bias=False)
        self.dt_proj = Linear(s.dt_rank, s.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(s.inner, s.d_state))
        self.D = nn.Parameter(torch.ones(s.inner))
        self.out_proj = Linear(s.inner, s.hidden, bias=s.proj_bias)
        if s.bcdt_weights:
            assert s.bcdt_eps is not None
            self.dt_layernorm = RMSNorm(s.dt_rank, s.bcdt_eps)
            self.b_layernorm = RMSNorm(s.d_state, s.bcdt_eps)
            self.c_layernorm = RMSNorm(s.d_state, s.bcdt_eps)

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        s = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, s.inner, 1, s.d_state, with_z=False),
                "conv": ConvEntry.empty(batch, s.conv_width, s.inner)}

    def _inputs(self, x: torch.Tensor, conv: ConvEntry, new: torch.Tensor | None
                ) -> tuple[torch.Tensor, ...]:
        """x ``[B, T, d]`` -> xs and z ``[B, T, inner]``, dt ``[B, T, inner]`` (after softplus;
        0 past a row's ``new`` count), B and C ``[B, T, N]``; fp32. Advances the window."""
        s = self.shape
        xs, z = self.in_proj.forward_fp32(x).chunk(2, dim=-1)
        weight = self.conv1d.weight.detach().float().squeeze(1).t().contiguous()
        xs = causal_conv(advance_window(conv, xs, new), weight, self.conv1d.bias, silu=True)
        low, b, c = self.x_proj.forward_fp32(xs).split([s.dt_rank, s.d_state, s.d_state], -1)
        if s.bcdt_weights:
            low, b, c = self.dt_layernorm(low), self.b_layernorm(b), self.c_layernorm(c)
        elif s.bcdt_eps is not None:
            low, b, c = (rms(y, s.bcdt_eps) for y in (low, b, c))
        dt = invariant.rowwise(F.softplus, self.dt_proj.forward_fp32(low))
        if new is not None:  # a ragged batch's padding: dt 0 keeps the state as it is
            real = torch.arange(x.shape[1])[None, :] < new[:, None]
            dt = dt * real[..., None]
        return xs, z, dt, b, c

    def _scan(self, xs: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              s: torch.Tensor, new: torch.Tensor | None) -> torch.Tensor:
        """The recurrence over T tokens: xs, dt ``[B, T, inner]``, b, c ``[B, T, N]``,
        s ``[B, inner, N]`` (updated in place), ``new [B]`` or None -> y ``[B, T, inner]``
        with the D skip. Natively where built (``mamba1_scan_``: one read and one write of
        the state, sixteen channels a vector), else token by token in ATen."""
        a = -self.A_log.float().exp()
        if kernels.available() and not torch.is_grad_enabled():
            rows, t = xs.shape[:2]
            counts = (torch.full((rows,), t, dtype=torch.long) if new is None
                      else new.to(torch.long).contiguous())
            y = torch.empty_like(xs)
            torch.ops.linserve.mamba1_scan_(s, y, xs, dt, a.contiguous(), b, c, counts)
            return y + xs * self.D.float()
        y = torch.empty_like(xs)
        for t in range(xs.shape[1]):
            decay = invariant.rowwise(torch.exp, dt[:, t, :, None] * a)  # [B, inner, N]
            s.mul_(decay).add_((dt[:, t] * xs[:, t])[..., None] * b[:, t, None, :])
            y[:, t] = invariant.sum_last(s * c[:, t, None, :]).squeeze(-1)
        return y + xs * self.D.float()

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` (``new [B]``: a right-padded ragged batch's real
        counts) -> ``[B, T, d]``."""
        del lengths
        rec: RecurrentEntry = entries["recurrent"]
        xs, z, dt, b, c = self._inputs(x, entries["conv"], new)
        y = self._scan(xs, dt, b, c, rec.s.squeeze(2), new)
        gated = y * invariant.rowwise(F.silu, z)
        return self.out_proj.forward_fp32(gated).to(x.dtype)

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]`` -> ``[B, d]``."""
        return self.forward(x.unsqueeze(1), entries, lengths).squeeze(1)
