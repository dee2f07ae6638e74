"""Gated DeltaNet (Qwen3.5, Qwen3-Next): the gated delta rule as a layer.

q, k, v come from one projection through a causal depthwise convolution (width K) and SiLU;
q and k are L2-normalised; per value head a decay g = −exp(A_log)·softplus(a + dt_bias) and a
write strength β = sigmoid(b) drive the gated delta rule (:mod:`linserve.model.layers.ops.delta`);
the output is RMS-normalised per head, gated by SiLU(z) and projected. Parameter names follow
Hugging Face's ``linear_attn`` modules. State per layer: a :class:`RecurrentEntry` S
``[B, Hv, Dk, Dv]`` fp32 and a :class:`ConvEntry` of the last K−1 projections.

Prefill runs the recurrent form natively (``gdn_scan``) where the kernels are built, else the
chunked WY form; a step runs natively (``gdn_step``) or in eager PyTorch, the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear
from linserve.model.layers.norms import GatedRMSNorm
from linserve.model.layers.ops.delta import delta_rule_chunked, delta_rule_step, l2norm
from linserve.model.state import ConvEntry, RecurrentEntry


@dataclass(frozen=True)
class DeltaShape:
    """A Gated DeltaNet layer's sizes: model width, key and value heads (Hk, Hv; Hv a
    multiple of Hk), per-head key and value sizes (Dk, Dv), conv width K, norm eps."""

    hidden: int
    key_heads: int
    value_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    separate_qkv: bool = False  # q, k and v projections stored apart (OLMo-Hybrid)
    # the channels of the q, k and v conv kernels as stored (None: the key, key and value
    # widths; transformers 5.23 saves OLMo-Hybrid's fused kernel as three equal thirds)
    conv_split: tuple[int, int, int] | None = None
    beta_scale: float = 1.0  # β = sigmoid(b) times this (2: OLMo-Hybrid's allow_neg_eigval)

    @property
    def conv_dim(self) -> int:
        """Channels through the convolution: q, k and v, ``2·Hk·Dk + Hv·Dv``."""
        return 2 * self.key_heads * self.head_k_dim + self.value_heads * self.head_v_dim


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (see the module docstring). ``[B, T, d]`` or ``[B, d]``."""

    # Prefill the delta rule natively in its recurrent form where the kernels are built
    # (False: the chunked WY form in PyTorch, the reference; ``bench.gdn_prefill`` compares)
    native_scan = True

    def __init__(self, sh: DeltaShape) -> None:
        super().__init__()
        self.shape = sh
        hk, hv = sh.key_heads, sh.value_heads
        dk, dv = sh.head_k_dim, sh.head_v_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        if sh.separate_qkv:
            self.in_proj_q = Linear(sh.hidden, self.key_dim, bias=False)
            self.in_proj_k = Linear(sh.hidden, self.key_dim, bias=False)
            self.in_proj_v = Linear(sh.hidden, self.value_dim, bias=False)
        else:
            self.in_proj_qkv = Linear(sh.hidden, sh.conv_dim, bias=False)
        self.in_proj_z = Linear(sh.hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(sh.hidden, hv, bias=False)
        self.in_proj_a = Linear(sh.hidden, hv, bias=False)
        if sh.separate_qkv:  # q, k and v convolved apart (their kernels stored apart)
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (
                nn.Conv1d(n, n, sh.conv_kernel, groups=n, bias=False)
                for n in sh.conv_split or (self.key_dim, self.key_dim, self.value_dim))
        else:
            self.conv1d = nn.Conv1d(sh.conv_dim, sh.conv_dim, sh.conv_kernel,
                                    groups=sh.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(dv, sh.eps, norm_before_gate=True)
        self.out_proj = Linear(self.value_dim, sh.hidden, bias=False)
        self._conv: tuple[int, torch.Tensor] | None = None

    def _causal_conv(self, full: torch.Tensor) -> torch.Tensor:
        """The depthwise causal convolution of ``full [B, K-1+T, C]`` -> ``[B, T, C]`` fp32
        (the native pass of ``prefill_ops.cpp`` where built: no transposes)."""
        if kernels.available() and not torch.is_grad_enabled():
            return torch.ops.linserve.causal_conv(full.contiguous(),
                                                  self.conv_weight())
        return F.conv1d(full.transpose(1, 2), self.conv_kernel().float(),
                        groups=full.shape[2]).transpose(1, 2)

    def in_weight(self) -> torch.Tensor:
        """The four input projections (qkv, z, b, a) as one GEMM weight
        ``[d, C + Hv·Dv + 2·Hv]`` (:func:`packing.gemm_weight`)."""
        qkv = ([self.in_proj_q.weight, self.in_proj_k.weight, self.in_proj_v.weight]
               if self.shape.separate_qkv else [self.in_proj_qkv.weight])
        return packing.gemm_weight(self, *qkv, self.in_proj_z.weight, self.in_proj_b.weight,
                                     self.in_proj_a.weight)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x ``[..., d]`` -> the projections mixed ``[..., C]``, z ``[..., Hv·Dv]``, b and a
        ``[..., Hv]`` (one GEMM; each in x's dtype, as separate layers would give them)."""
        hv = self.shape.value_heads
        proj = invariant.project(x, self.in_weight()).to(x.dtype)
        return proj.split([self.shape.conv_dim, self.value_dim, hv, hv], dim=-1)

    def _heads(self, mixed: torch.Tensor, b_in: torch.Tensor, a_in: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
        """Convolved projections ``[B, T, conv_dim]`` and the gate inputs b, a
        ``[B, T, Hv]`` -> q, k ``[B, Hv, T, Dk]`` (normalised, q scaled), v
        ``[B, Hv, T, Dv]``, g and β ``[B, Hv, T]``, all fp32."""
        sh = self.shape
        b, t, _ = mixed.shape
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = sh.value_heads // sh.key_heads
        q, k = (y.reshape(b, t, sh.key_heads, -1).repeat_interleave(rep, dim=2)
                for y in (q, k))
        v = v.reshape(b, t, sh.value_heads, -1)
        beta = invariant.rowwise(torch.sigmoid, b_in.float())
        if sh.beta_scale != 1.0:
            beta = beta * sh.beta_scale
        g = -self.A_log.float().exp() * invariant.rowwise(
            F.softplus, a_in.float() + self.dt_bias.float())
        q, k, v, g, beta = (y.transpose(1, 2) for y in (q, k, v, g, beta))
        q = l2norm(q) * sh.head_k_dim ** -0.5
        return q, l2norm(k), v.contiguous(), g.contiguous(), beta.contiguous()

    def _finish(self, o: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, Hv, T, Dv]`` -> gated norm with z ``[B, T, Hv·Dv]``, output projection
        ``[B, T, d]``."""
        b, _, t, dv = o.shape
        out = self.norm(o.transpose(1, 2), z.reshape(b, t, -1, dv)).reshape(b, t, -1)
        return self.out_proj(out.to(x.dtype))

    def forward(self, x: torch.Tensor, rec: RecurrentEntry, conv: ConvEntry,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]``; replaces the entries' tensors. The delta rule runs
        natively in its recurrent form where the kernels are built (:meth:`_scan_native`),
        else in the chunked WY form (tested equal). ``new [B]``: how many of the T are real
        per row (a right-padded ragged batch); the padding then writes nothing (β = 0, no
        decay, zero q, k, v, as the chunked form's own padding) and the conv window keeps
        each row's last real inputs."""
        mixed, z, b_in, a_in = self._project(x)
        k1 = conv.window.shape[1]
        full = conv.window.new_empty(x.shape[0], k1 + x.shape[1], mixed.shape[-1])
        full[:, :k1] = conv.window  # [B, K-1+T, C]: the window, then the new projections
        full[:, k1:] = mixed
        ends = [full.shape[1] - k1] * full.shape[0] if new is None else new.tolist()
        conv.window = torch.stack([full[i, n : n + k1] for i, n in enumerate(ends)]
                                  ).contiguous()
        if self.native_scan and kernels.available() and not torch.is_grad_enabled():
            return self._scan_native(full, (z, b_in, a_in), rec, new, x)
        mixed = invariant.rowwise(F.silu, self._causal_conv(full))
        q, k, v, g, beta = self._heads(mixed, b_in, a_in)
        if new is not None:
            valid = torch.arange(x.shape[1])[None] < new[:, None]  # [B, T]
            q, k, v = (torch.where(valid[:, None, :, None], y, 0.0) for y in (q, k, v))
            g, beta = (torch.where(valid[:, None], y, 0.0) for y in (g, beta))
        o, s = delta_rule_chunked(q, k, v, g, beta, rec.s)
        rec.s = s.contiguous()
        return self._finish(o, z, x)

    def _scan_native(self, full: torch.Tensor, gates: tuple[torch.Tensor, ...],
                     rec: RecurrentEntry, new: torch.Tensor | None, x: torch.Tensor
                     ) -> torch.Tensor:
        """The delta rule over the prompt in its recurrent form, natively
        (``gdn_scan``): each head's state stays in cache over all T tokens, where the chunked
        form's small matrix products, triangular solves and transposes cost 3× more on a
        CPU; the convolution, SiLU and q/k norms in the same native
        call. ``full [B, K-1+T, C]`` the conv windows and new projections; ``gates`` z, b, a
        (in x's dtype); replaces ``rec.s``."""
        sh = self.shape
        b = full.shape[0]
        t = full.shape[1] - sh.conv_kernel + 1
        zba = torch.cat([y.float() for y in gates], dim=-1).contiguous()
        lengths = new if new is not None else torch.full((b,), t, dtype=torch.long)
        s = rec.s.clone(memory_format=torch.contiguous_format)
        out = torch.ops.linserve.gdn_scan(
            full.contiguous(), self.conv_weight(), zba,
            self.A_log.float().contiguous(), self.dt_bias.float().contiguous(), s,
            self.norm.weight.float().contiguous(),
            lengths, sh.key_heads, sh.eps, sh.beta_scale)
        rec.s = s
        return self.out_proj(out.to(x.dtype))

    def step_fused(self, x: torch.Tensor, rec: RecurrentEntry, conv: ConvEntry
                   ) -> torch.Tensor:
        """:meth:`step` through ``linserve/model/kernels/gdn_step.cpp`` (one GEMM for the four input
        projections, then convolution, delta rule and gated norm in one native pass)."""
        sh = self.shape
        mixed, z, b, a = (y.float() for y in self._project(x))
        out = torch.ops.linserve.gdn_step(
            mixed.contiguous(), conv.window, self.conv_weight(), a.contiguous(), b.contiguous(),
            self.A_log.float().contiguous(), self.dt_bias.float().contiguous(), rec.s,
            z.contiguous(), self.norm.weight.float().contiguous(), sh.key_heads,
            sh.eps, sh.beta_scale)
        return self.out_proj(out.to(x.dtype))

    def conv_kernel(self) -> torch.Tensor:
        """The depthwise kernel ``[C, 1, K]`` as one (q, k and v's side by side)."""
        if self.shape.separate_qkv:
            return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        return self.conv1d.weight

    def conv_weight(self) -> torch.Tensor:
        """The depthwise kernel transposed, ``[K, C]`` fp32 (cached with the stacked weights):
        the native kernels' loops run over C."""
        first = (self.q_conv1d if self.shape.separate_qkv else self.conv1d).weight.data_ptr()
        if self._conv is None or self._conv[0] != first:
            self._conv = (first, self.conv_kernel().detach().float().squeeze(1).t().contiguous())
        return self._conv[1]

    def step(self, x: torch.Tensor, rec: RecurrentEntry, conv: ConvEntry) -> torch.Tensor:
        """One token per row ``[B, d]``; updates the entries in place."""
        if kernels.available() and not torch.is_grad_enabled() and rec.s.is_contiguous():
            return self.step_fused(x, rec, conv)
        return self.step_eager(x, rec, conv)

    def step_eager(self, x: torch.Tensor, rec: RecurrentEntry, conv: ConvEntry
                   ) -> torch.Tensor:
        """:meth:`step` in eager PyTorch (the reference the fused step is tested against)."""
        mixed, z, b_in, a_in = self._project(x)
        mixed = mixed.float()  # [B, C]
        window = torch.cat([conv.window, mixed.unsqueeze(1)], dim=1)  # [B, K, C]
        conv.window.copy_(window[:, 1:])
        w = self.conv_kernel().float().squeeze(1)  # [C, K]
        mixed = invariant.rowwise(F.silu, (window * w.T).sum(1))
        q, k, v, g, beta = self._heads(mixed.unsqueeze(1), b_in.unsqueeze(1), a_in.unsqueeze(1))
        o = delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], rec.s)
        return self._finish(o.unsqueeze(2), z.unsqueeze(1), x.unsqueeze(1)).squeeze(1)


class DeltaMixer(nn.Module):
    """A :class:`GatedDeltaNet` (``delta``) behind the decoder's mixer interface, for a
    :class:`~linserve.model.layers.block.Block` (OLMo-Hybrid's linear layers). State:
    ``{"recurrent": S [B, Hv, Dk, Dv], "conv": the last K−1 projections}``."""

    def __init__(self, sh: DeltaShape) -> None:
        super().__init__()
        self.delta = GatedDeltaNet(sh)

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        sh = self.delta.shape
        return {"recurrent": RecurrentEntry.empty(batch, sh.value_heads, sh.head_k_dim,
                                                  sh.head_v_dim, with_z=False),
                "conv": ConvEntry.empty(batch, sh.conv_kernel, sh.conv_dim)}

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` -> ``[B, T, d]`` (``new``: a ragged batch's counts)."""
        del lengths
        return self.delta(x, entries["recurrent"], entries["conv"], new)

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]``; the entries updated in place."""
        del lengths
        return self.delta.step(x, entries["recurrent"], entries["conv"])
