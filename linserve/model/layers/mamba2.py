"""The Mamba2 mixer, as transformers' reference computes it (Granite-4.0-H, Nemotron-H,
Falcon-H1): ``in_proj`` to z, xBC and dt; a causal depthwise convolution and SiLU over xBC;
the selective state space (SSD) with one scalar decay per head, ``exp(dt · A)``, A = −exp(A_log)
and dt = softplus(dt + dt_bias) clamped to ``time_step_limit``; the D skip; a gated RMSNorm
grouped by ``n_groups``; ``out_proj``.

Per head h the state is S ``[P, N]`` (head_dim × d_state): S ← exp(dt A) S + dt · x Bᵀ, and
y = S C + D x. A step runs the recurrence (:meth:`Mamba2.step`); a prefill runs it natively,
token by token (``mamba2_scan_``), or without native kernels the chunked SSD form
(:func:`ssd_chunked`); each row alone, so a row's result does not depend on its batch. All
are tested equal within fp32 rounding. State: a :class:`linserve.model.state.RecurrentEntry`
``s [B, H, P, N]`` and the conv window, both fp32 and constant in size, updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels
from linserve.model.invariant import Linear
from linserve.model.layers.hf_keys import json_float
from linserve.model.layers.norms import GatedRMSNorm
from linserve.model.layers.short_conv import advance_window, causal_conv
from linserve.model.state import ConvEntry, RecurrentEntry

CHUNK = 64


@dataclass(frozen=True)
class Mamba2Shape:
    """``heads · head_dim`` is the inner width; ``groups`` share B and C (and group the
    gated norm); ``dt_limit`` is ``time_step_limit``."""

    hidden: int
    heads: int
    head_dim: int
    d_state: int
    groups: int
    conv_width: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    norm_before_gate: bool = False
    gated_norm: bool = True  # False: y · silu(z), no norm (Falcon-H1's mamba_rms_norm off)
    in_multiplier: float = 1.0  # Falcon-H1's ssm_in_multiplier, on the layer's input
    # Falcon-H1's ssm_multipliers: z, x, B, C and dt of the input projection scaled
    proj_multipliers: tuple[float, float, float, float, float] | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any], eps: float, **fields: Any) -> Mamba2Shape:
        """The shape of the ``mamba_*`` keys Bamba, Granite-4.0-H and Falcon-H1 share:
        ``mamba_n_heads``, ``mamba_d_head`` (or "auto": the width over the heads), the width
        ``mamba_d_ssm`` or ``mamba_expand`` × ``hidden_size``, ``mamba_d_state``,
        ``mamba_n_groups``, ``mamba_d_conv``, the conv and projection biases and
        ``time_step_limit``; ``fields``: the family's own, over these. ValueError when the
        heads do not fill the width."""
        d = int(c["hidden_size"])
        inner = int(c.get("mamba_d_ssm") or int(c.get("mamba_expand", 2)) * d)
        heads = int(c["mamba_n_heads"])
        head_dim = c.get("mamba_d_head", "auto")
        head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
        if heads * head_dim != inner:
            raise ValueError("mamba_n_heads × mamba_d_head is not the Mamba2 width "
                             "(mamba_d_ssm, or mamba_expand × hidden_size)")
        limit = c.get("time_step_limit") or (0.0, float("inf"))
        return cls(d, heads, head_dim, int(c["mamba_d_state"]), int(c.get("mamba_n_groups", 1)),
                   int(c.get("mamba_d_conv", 4)), eps, bool(c.get("mamba_conv_bias", True)),
                   bool(c.get("mamba_proj_bias", False)),
                   (json_float(limit[0]), json_float(limit[1])), **fields)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.d_state


# exp(x) of x below this is flushed to exactly 0 (exp(-60) ≈ 9e-27). A fast-decaying head's
# decays reach fp32's subnormal range, where every product traps to microcode: the SSD of one
# row's 128 tokens at Granite-4.0-H's shape took 27 ms instead of 8. A term flushed is below
# 1e-26 of one whose decay is 1 (the token's own, or the last of a chunk), far below fp32's
# rounding of the sum.
_FLUSH = -60.0


def _exp_flushed(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, 0 where ``x < _FLUSH`` (never a subnormal)."""
    return x.clamp(min=_FLUSH).exp_().masked_fill_(x < _FLUSH, 0.0)


def _segsum_exp(a: torch.Tensor) -> torch.Tensor:
    """``a [..., L]`` (≤ 0) -> ``exp(Σ a[s+1..l]) [..., L, L]`` for s ≤ l, else 0 (flushed
    as :func:`_exp_flushed`)."""
    cs = a.cumsum(-1)
    diff = cs[..., :, None] - cs[..., None, :]
    drop = (diff < _FLUSH) | ~torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool).tril()
    return diff.clamp(_FLUSH, 0.0).exp_().masked_fill_(drop, 0.0)


def _chunk_starts(states: torch.Tensor, ends: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """The recurrence over chunks: ``states [n, H, P, N]`` (each chunk's own writes),
    ``ends [n, H]`` (each chunk's whole decay), ``s0 [H, P, N]`` -> the state at each chunk's
    start and after the last, ``[n + 1, H, P, N]``."""
    out = torch.empty(states.shape[0] + 1, *states.shape[1:])
    out[0] = s0
    for k in range(states.shape[0]):
        torch.addcmul(states[k], out[k], ends[k][:, None, None], out=out[k + 1])
    return out


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, s0: torch.Tensor, chunk: int = CHUNK
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD over one row's T tokens in chunks: x ``[T, H, P]``, dt ``[T, H]`` (after
    softplus), a ``[H]`` (negative), b, c ``[T, G, N]`` (a group's shared by its H / G heads),
    s0 ``[H, P, N]`` -> y ``[T, H, P]`` (without the D skip) and the final state
    ``[H, P, N]``, all fp32."""
    t, heads, p = x.shape
    groups, n_state = b.shape[1:]
    pad = (-t) % chunk
    if pad:  # zero dt: no decay and no write
        x, dt, b, c = (F.pad(y, (0, 0) * (y.dim() - 1) + (0, pad)) for y in (x, dt, b, c))
    n = x.shape[0] // chunk
    x, dt, b, c = (y.reshape(n, chunk, *y.shape[1:]) for y in (x, dt, b, c))
    da = (dt * a).permute(0, 2, 1)  # [n, H, L]
    acs = da.cumsum(-1)
    xdt = x * dt[..., None]  # [n, L, H, P]
    # within a chunk: y_l = Σ_{s≤l} (C_l · B_s) exp(Σ da[s+1..l]) xdt_s; C·B once per group
    cb = torch.einsum("clgn,csgn->cgls", c, b)[:, :, None]  # [n, G, 1, L, L]
    seg = _segsum_exp(da).view(n, groups, heads // groups, chunk, chunk)
    y = torch.einsum("chls,cshp->clhp", (cb * seg).view(n, heads, chunk, chunk), xdt)
    # each chunk's writes, decayed to its end; then the states between chunks in order
    bh = b.repeat_interleave(heads // groups, dim=2)  # [n, L, H, N]
    decayed = bh * _exp_flushed(acs[..., -1:] - acs).permute(0, 2, 1)[..., None]
    states = torch.einsum("clhn,clhp->chpn", decayed, xdt)
    starts = _chunk_starts(states, _exp_flushed(acs[:, :, -1]), s0)
    # the state at a chunk's start, read by its tokens: C_l · S decayed to l
    read = torch.einsum("clgn,cgqn->clgq", c, starts[:n].view(n, groups, -1, n_state))
    y = y + read.reshape(n, chunk, heads, p) * _exp_flushed(acs).permute(0, 2, 1)[..., None]
    return y.reshape(n * chunk, heads, p)[:t], starts[n]


class Mamba2(nn.Module):
    """See the module docstring. Parameters ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
    ``D``, ``norm``, ``out_proj``, as transformers names them."""

    # the chunked prefill and the recurrent step agree within fp32 rounding, not bit for bit
    split_invariant = False

    def __init__(self, shape: Mamba2Shape) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.in_proj = Linear(s.hidden, s.inner + s.conv_dim + s.heads, bias=s.proj_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_width, groups=s.conv_dim,
                                bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.heads))
        self.A_log = nn.Parameter(torch.zeros(s.heads))
        self.D = nn.Parameter(torch.ones(s.heads))
        if s.gated_norm:
            self.norm = GatedRMSNorm(s.inner, s.eps, s.groups, s.norm_before_gate)
        self.out_proj = Linear(s.inner, s.hidden, bias=s.proj_bias)
        self._w: tuple[int, torch.Tensor] | None = None

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        s = self.shape
        return {"recurrent": RecurrentEntry.empty(batch, s.heads, s.head_dim, s.d_state,
                                                  with_z=False),
                "conv": ConvEntry.empty(batch, s.conv_width, s.conv_dim)}

    def conv_weight(self) -> torch.Tensor:
        """The kernel as ``[K, C]`` fp32 (cached while the weight stays the same tensor)."""
        if self._w is None or self._w[0] != self.conv1d.weight.data_ptr():
            self._w = (self.conv1d.weight.data_ptr(),
                       self.conv1d.weight.detach().float().squeeze(1).t().contiguous())
        return self._w[1]

    def _inputs(self, x: torch.Tensor, conv: ConvEntry, new: torch.Tensor | None
                ) -> tuple[torch.Tensor, ...]:
        """x ``[B, T, d]`` -> z ``[B, T, inner]``, xs ``[B, T, H, P]``, B and C
        ``[B, T, G, N]``, dt ``[B, T, H]``; fp32.
        Advances the conv window."""
        s = self.shape
        proj = self.in_proj.forward_fp32(x * s.in_multiplier if s.in_multiplier != 1.0 else x)
        if s.proj_multipliers is not None:
            proj = proj * self._proj_scale()
        z, xbc, dt = proj.split([s.inner, s.conv_dim, s.heads], dim=-1)
        conv_out = causal_conv(advance_window(conv, xbc, new), self.conv_weight(),
                               self.conv1d.bias, silu=True)
        xs, b, c = conv_out.split([s.inner, s.groups * s.d_state, s.groups * s.d_state], dim=-1)
        bt, t = x.shape[:2]
        b, c = (y.reshape(bt, t, s.groups, s.d_state) for y in (b, c))
        dt = invariant.rowwise(F.softplus, dt + self.dt_bias.float())
        dt = dt.clamp(min=s.dt_limit[0], max=s.dt_limit[1])
        return z, xs.reshape(bt, t, s.heads, s.head_dim), b, c, dt

    def _proj_scale(self) -> torch.Tensor:
        """The input projection's per-column multipliers ``[inner + conv_dim + H]``."""
        s = self.shape
        assert s.proj_multipliers is not None
        sizes = [s.inner, s.inner, s.groups * s.d_state, s.groups * s.d_state, s.heads]
        return torch.cat([torch.full((n,), m) for n, m in zip(sizes, s.proj_multipliers,
                                                               strict=True)])

    def _out(self, y: torch.Tensor, xs: torch.Tensor, z: torch.Tensor, x: torch.Tensor
             ) -> torch.Tensor:
        """y ``[B, T, H, P]`` + the D skip, gated norm with z (or y · silu(z)), ``out_proj``
        -> ``[B, T, d]``. Natively where built: one pass a row, in place on y, with the
        native step's code (``mamba2_gate_``)."""
        if kernels.available() and not torch.is_grad_enabled():
            gated = self._gate_native(y, xs, z)
        else:
            y = (y + xs * self.D.float()[:, None]).reshape(*y.shape[:2], -1)
            gated = self.norm(y, z) if self.shape.gated_norm else y * invariant.rowwise(F.silu, z)
        return self.out_proj.forward_fp32(gated).to(x.dtype)

    def _gate_native(self, y: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """:meth:`_out`'s D skip and gate by the native op: y, xs ``[B, T, H, P]``, z
        ``[B, T, inner]`` -> ``[B, T, inner]`` fp32 (y's storage when it is contiguous)."""
        s = self.shape
        rows = y.shape[0] * y.shape[1]
        flat = y.reshape(rows, s.inner).contiguous()
        norm = self.norm if s.gated_norm else None
        weight = norm.weight.float() if norm is not None else torch.empty(0)
        torch.ops.linserve.mamba2_gate_(
            flat, xs.reshape(rows, s.inner).float(), self.D.float(),
            z.reshape(rows, s.inner).float(), weight, norm.groups if norm else 1,
            norm.eps if norm else 0.0, bool(norm.norm_before_gate) if norm else False)
        return flat.view(*y.shape[:2], s.inner)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                new: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` (``new [B]``: a right-padded ragged batch's real
        counts) -> ``[B, T, d]``; each row's SSD runs alone (chunked form)."""
        del lengths
        rec: RecurrentEntry = entries["recurrent"]
        z, xs, b, c, dt = self._inputs(x, entries["conv"], new)
        if kernels.available() and not torch.is_grad_enabled():
            y = self._scan_native(xs, dt, b, c, rec.s, new)
        else:
            a = -self.A_log.float().exp()
            y = torch.zeros_like(xs)
            counts = [x.shape[1]] * x.shape[0] if new is None else new.tolist()
            for i, n in enumerate(counts):
                y[i, :n], s = ssd_chunked(xs[i, :n], dt[i, :n], a, b[i, :n], c[i, :n],
                                          rec.s[i])
                rec.s[i] = s
        return self._out(y, xs, z, x)

    def _scan_native(self, xs: torch.Tensor, dt: torch.Tensor, b: torch.Tensor,
                     c: torch.Tensor, s: torch.Tensor, new: torch.Tensor | None
                     ) -> torch.Tensor:
        """The SSD of every row by the native recurrence (``mamba2_scan_``, the step's code a
        token at a time): xs ``[B, T, H, P]``, dt ``[B, T, H]``, b and c ``[B, T, G, N]``,
        s ``[B, H, P, N]`` (updated in place), ``new [B]`` or None (all T) -> y
        ``[B, T, H, P]`` without the D skip (zeros past a row's count)."""
        rows, t = xs.shape[:2]
        counts = (torch.full((rows,), t, dtype=torch.long) if new is None
                  else new.to(torch.long).contiguous())
        y = torch.empty_like(xs)
        torch.ops.linserve.mamba2_scan_(
            s, y.view(rows, t, -1), xs.flatten(2), dt.contiguous(),
            self.A_log.detach().float().contiguous(), b.flatten(2), c.flatten(2), counts)
        return y

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor:
        """One token per row ``[B, d]``: the recurrence, elementwise and with in-order sums,
        so a row's result does not depend on the batch; updates the state in place."""
        del lengths
        rec: RecurrentEntry = entries["recurrent"]
        z, xs, b, c, dt = (y[:, 0] for y in self._inputs(x.unsqueeze(1), entries["conv"], None))
        b, c = (y.repeat_interleave(self.shape.heads // self.shape.groups, dim=1) for y in (b, c))
        decay = invariant.rowwise(torch.exp, dt * -self.A_log.float().exp())  # [B, H]
        rec.s.mul_(decay[:, :, None, None]).add_(
            (xs * dt[..., None])[..., None] * b[:, :, None, :])
        y = invariant.sum_last(rec.s * c[:, :, None, :]).squeeze(-1)  # [B, H, P]
        return self._out(y.unsqueeze(1), xs.unsqueeze(1), z.unsqueeze(1),
                         x.unsqueeze(1)).squeeze(1)
