"""Transformer building blocks: the two attention modules, the MLP and a pre-norm block.

Activations are ``[B, T, d_model]`` in the parallel form and ``[B, d_model]`` in the step
form. Attention maths and all recurrent state run in fp32 whatever the weight dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import kernels
from linserve.model.invariant import Linear
from linserve.model.layers.ops.features import draw_orthogonal_features, elu_feature, favor_features
from linserve.model.layers.ops.gated import (
    GATE_TEMPERATURE,
    LOG_GATE_MIN,
    gated_linear_parallel,
    gated_linear_step,
    log_gate,
)
from linserve.model.layers.ops.linear import causal_linear_parallel, causal_linear_step
from linserve.model.layers.ops.softmax import (
    apply_rope,
    rope_at,
    rope_tables,
    softmax_parallel,
    softmax_step,
    window_parallel,
)
from linserve.model.own_config import ModelConfig
from linserve.model.state import ConvEntry, KVEntry, RecurrentEntry, State


def native_inference() -> bool:
    """Whether to use the native prefill kernels (``prefill_ops.cpp``): loaded, and no
    autograd to serve (training keeps ATen's differentiable ops)."""
    return kernels.available() and not torch.is_grad_enabled()


def gate_bias_init(heads: int, features: int, lo: float = 0.9, hi: float = 0.999
                   ) -> torch.Tensor:
    """Gate logits ``[H·F]`` whose gates g = sigmoid(x)^(1/16) start spread log-uniformly over
    [lo, hi] within each head: some features forget within ~10 tokens, others keep ~1000."""
    log_g = -torch.logspace(math.log10(-math.log(lo)), math.log10(-math.log(hi)), features)
    y = GATE_TEMPERATURE * log_g  # = logsigmoid(x)
    x = y - torch.log(-torch.expm1(y))  # the inverse of logsigmoid
    return x.repeat(heads)


def head_decay_init(heads: int, lo: float = 0.95, hi: float = 0.999) -> torch.Tensor:
    """θ ``[H]`` for decays γ_h = exp(-exp(θ_h)) spread log-uniformly over [lo, hi]: memories
    from ~20 to ~1000 tokens, like the gate's initial spread."""
    rates = torch.logspace(math.log10(-math.log(lo)), math.log10(-math.log(hi)), heads)
    return rates.log()


def _recurrent(state: State, layer: int) -> tuple[RecurrentEntry, ConvEntry]:
    """A recurrent layer's two entries: the (s, z) sums and the short-conv window."""
    rec, conv = state.layers[layer]["recurrent"], state.layers[layer]["conv"]
    assert isinstance(rec, RecurrentEntry) and isinstance(conv, ConvEntry)
    return rec, conv


def _z(rec: RecurrentEntry) -> torch.Tensor:
    assert rec.z is not None, "these models normalise by z"
    return rec.z


def _kv(state: State, layer: int) -> KVEntry:
    kv = state.layers[layer]["kv"]
    assert isinstance(kv, KVEntry)
    return kv


class LinearAttention(nn.Module):
    """Causal linear attention (elu+1 or FAVOR+) with an optional short causal conv on q/k/v
    and an optional data-dependent forget gate (``gate_rank > 0``)."""

    favor_w: torch.Tensor  # [m, D] FAVOR+ projection (buffer; only for attention="favor")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.qkv = Linear(d, 3 * d, bias=False)
        self.out = Linear(d, d, bias=False)
        self.conv: nn.Parameter | None = None
        if cfg.conv_size > 0:  # depthwise causal conv; identity at init
            w = torch.zeros(3 * d, cfg.conv_size)
            w[:, -1] = 1.0
            self.conv = nn.Parameter(w)
        if cfg.attention == "favor":
            w_feat = draw_orthogonal_features(cfg.n_features, cfg.head_dim, cfg.favor_seed)
            self.register_buffer("favor_w", w_feat)
        self.gate_down: nn.Linear | None = None
        self.gate_up: nn.Linear | None = None
        if cfg.gate_rank > 0:  # GLA's low-rank gate: d -> rank -> H·F logits
            self.gate_down = Linear(d, cfg.gate_rank, bias=False)
            self.gate_up = Linear(cfg.gate_rank, cfg.n_heads * cfg.feature_dim)
            with torch.no_grad():
                self.gate_up.bias.copy_(gate_bias_init(cfg.n_heads, cfg.feature_dim))
        self.decay: nn.Parameter | None = None
        if cfg.head_decay:  # ablation: log g_h = -exp(θ_h), one learned decay per head
            self.decay = nn.Parameter(head_decay_init(cfg.n_heads))
        self.o_norm: nn.Parameter | None = None
        if cfg.output_norm:  # ablation: GLA's per-head RMSNorm in place of the denominator
            self.o_norm = nn.Parameter(torch.ones(cfg.n_heads, cfg.head_dim))

    def _log_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """x ``[..., d]`` -> log-gates ``[..., H, F]`` in fp32, or None for an ungated model."""
        if self.decay is not None:
            lg = (-self.decay.float().exp()).clamp(min=LOG_GATE_MIN)  # [H]
            return lg[:, None].expand(*x.shape[:-1], self.cfg.n_heads, self.cfg.feature_dim)
        if self.gate_down is None or self.gate_up is None:
            return None
        lg = log_gate(self.gate_up(self.gate_down(x)))
        return lg.view(*x.shape[:-1], self.cfg.n_heads, self.cfg.feature_dim)

    def _norm_out(self, o: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """The output-norm ablation: RMSNorm over each head's ``M`` values of the numerator
        φ(q)ᵀs, times ``weight`` (``[H, M]``, or ``[H, 1, M]`` for ``[B, H, T, M]``)."""
        if weight is None:
            return o
        return F.rms_norm(o, (o.shape[-1],), eps=self.cfg.eps) * weight.float()

    def _phi(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        if self.cfg.qk_norm:  # ablation: unit-length q and k per head before the map
            x = F.normalize(x, dim=-1)
        if self.cfg.attention == "favor":
            return favor_features(x, self.favor_w, is_query)
        return elu_feature(x)

    def _features(self, qkv: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv ``[B, T, 3d]`` fp32 -> φ(q), φ(k) ``[B, H, T, F]`` and v ``[B, H, T, D]``: one
        native pass (head split and elu+1) where it applies, else the eager map."""
        h = self.cfg.n_heads
        if native_inference() and self.cfg.attention == "linear" and not self.cfg.qk_norm:
            fq, fk, v = torch.ops.linserve.qkv_features(qkv.contiguous(), h)
            return fq, fk, v
        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, 3, h, self.cfg.head_dim).permute(2, 0, 3, 1, 4)
        return self._phi(q, True), self._phi(k, False), v

    def _conv_parallel(self, qkv: torch.Tensor, buf: torch.Tensor | None,
                       lengths: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qkv ``[B, T, 3d]``, buf ``[B, K-1, 3d]`` -> (conv output, new buf). With right-padded
        rows of ``lengths [B]``, each row's new buffer ends at its own last real token."""
        if self.conv is None:
            return qkv, buf
        k = self.conv.shape[1]
        if buf is None:
            buf = qkv.new_zeros(qkv.shape[0], k - 1, qkv.shape[2])
        full = torch.cat([buf, qkv], dim=1)
        if native_inference():
            w = self.conv.T.float().contiguous()  # [K, 3d]
            out = torch.ops.linserve.causal_conv(full.contiguous(), w)
        else:
            out = F.conv1d(full.transpose(1, 2), self.conv.float().unsqueeze(1),
                           groups=qkv.shape[2]).transpose(1, 2)
        if lengths is None:
            return out, full[:, full.shape[1] - (k - 1):]
        # full index j holds qkv position j - (K-1): row b's last K-1 real inputs start at len_b
        idx = lengths[:, None] + torch.arange(k - 1)[None, :]  # [B, K-1]
        new_buf = full.gather(1, idx[:, :, None].expand(-1, -1, full.shape[2]))
        return out, new_buf

    def forward(self, x: torch.Tensor, state: State | None, layer: int,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Parallel form. x ``[B, T, d]``; updates ``state`` (if given) in place.

        ``lengths [B]`` marks rows right-padded to T: padded keys and values are zeroed, so
        they add nothing to s and z (a sum), and the outputs at real positions, being causal,
        never see them. Outputs at padded positions are garbage, for the caller to ignore.
        """
        b, t, _ = x.shape
        h, dh = self.cfg.n_heads, self.cfg.head_dim
        rec, conv = (None, None) if state is None else _recurrent(state, layer)
        qkv, new_buf = self._conv_parallel(self.qkv(x).float(), None if conv is None
                                           else conv.window, lengths)
        fq, fk, v = self._features(qkv)
        if rec is None:
            s = x.new_zeros(b, h, self.cfg.feature_dim, dh, dtype=torch.float32)
            z = x.new_zeros(b, h, self.cfg.feature_dim, dtype=torch.float32)
        else:
            s, z = rec.s, _z(rec)
        lg = self._log_gate(x)
        lg = None if lg is None else lg.transpose(1, 2)  # [B, H, T, F]
        if lengths is not None:  # padding: no key, no value, and a gate of 1 (log 0)
            real = (torch.arange(t)[None, :] < lengths[:, None]).to(fk.dtype)[:, None, :, None]
            fk, v = fk * real, v * real
            lg = None if lg is None else lg * real
        if lg is None:
            o, s_new, z_new = causal_linear_parallel(
                fq, fk, v, s, z, self.cfg.chunk_size, self.cfg.eps)
        else:
            o, s_new, z_new = gated_linear_parallel(
                fq, fk, v, lg, s, z, self.cfg.chunk_size, self.cfg.eps,
                normalise=self.o_norm is None)
            o = self._norm_out(o, self.o_norm[:, None] if self.o_norm is not None else None)
        if rec is not None and conv is not None:  # contiguous, as the fused step needs them
            rec.s, rec.z = s_new.contiguous(), z_new.contiguous()
            if new_buf is not None:  # a copy: the slice would keep the whole input alive
                conv.window = new_buf.clone(memory_format=torch.contiguous_format)
        return self.out(o.transpose(1, 2).reshape(b, t, -1).to(x.dtype))

    def step(self, x: torch.Tensor, state: State, layer: int) -> torch.Tensor:
        """Recurrent form. x ``[B, d]``; updates s, z and the conv buffer in place."""
        b = x.shape[0]
        h, dh = self.cfg.n_heads, self.cfg.head_dim
        rec, conv = _recurrent(state, layer)
        qkv = self.qkv(x).float()
        if self.conv is not None:
            buf = conv.window  # [B, K-1, 3d]
            window = torch.cat([buf, qkv.unsqueeze(1)], dim=1)  # [B, K, 3d]
            qkv = (window * self.conv.T.float()).sum(1)
            buf.copy_(window[:, 1:])
        q, k, v = qkv.view(b, 3, h, dh).unbind(1)  # [B, H, D]
        lg = self._log_gate(x)
        if lg is None:
            o = causal_linear_step(self._phi(q, True), self._phi(k, False), v,
                                   rec.s, _z(rec), self.cfg.eps)
        else:
            o = gated_linear_step(self._phi(q, True), self._phi(k, False), v, lg,
                                  rec.s, _z(rec), self.cfg.eps,
                                  normalise=self.o_norm is None)
            o = self._norm_out(o, self.o_norm)
        return self.out(o.reshape(b, -1).to(x.dtype))


class SoftmaxAttention(nn.Module):
    """Multi-head softmax attention with rotary positions, for the KV-cache baselines: full
    causal attention, or with ``window = W`` local attention over the last W tokens whose cache
    is a ring of W slots (see :mod:`linserve.model.layers.ops.softmax`)."""

    cos: torch.Tensor  # [max_context, D/2]
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = Linear(cfg.d_model, cfg.d_model, bias=False)
        cos, sin = rope_tables(cfg.max_context, cfg.head_dim, cfg.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, d]``, pos ``[B|1, T]`` -> rotated q, k and v, each ``[B, H, T, D]``.
        Positions past the rotary table (window models have no length limit) are computed."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).float().view(b, t, 3, self.cfg.n_heads, -1).permute(2, 0, 3, 1, 4)
        if int(pos.max()) < self.cos.shape[0]:
            cos, sin = self.cos[pos], self.sin[pos]
        else:
            cos, sin = rope_at(pos, self.cfg.head_dim, self.cfg.rope_base)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, state: State | None, layer: int) -> torch.Tensor:
        """Parallel form over T new tokens; all rows start at the same cache length."""
        b, t, _ = x.shape
        cache = None if state is None else _kv(state, layer)
        start = 0 if state is None else int(state.lengths[0])
        pos = torch.arange(start, start + t, device=x.device)
        q, k, v = self._qkv(x, pos.unsqueeze(0))
        if cache is not None:  # the chunk's own keys as the cache holds them, as a step sees
            k, v = cache.as_stored(k), cache.as_stored(v)
        if self.cfg.window:
            o = self._window_forward(q, k, v, pos, cache)
        else:
            k_past = v_past = None
            if cache is not None:
                k_past = cache.keys(slice(None), start)
                v_past = cache.values(slice(None), start)
            o = softmax_parallel(q, k, v, k_past, v_past)
            if cache is not None:
                cache.put(slice(None), slice(start, start + t), k, v)
        return self.out(o.transpose(1, 2).reshape(b, t, -1).to(x.dtype))

    def _window_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        pos: torch.Tensor, cache: KVEntry | None) -> torch.Tensor:
        """Local attention of new tokens at ``pos [T]`` over the ring's past keys and their own;
        then the last min(T, W) new keys go into their slots (pos mod W)."""
        w = self.cfg.window
        start = int(pos[0])
        keys, values, k_pos = k, v, pos
        if cache is not None and start > 0:
            past = torch.arange(max(0, start - w + 1), start)  # the past keys any query sees
            slots = past % w
            keys = torch.cat([cache.read("k", slice(None), slots), k], dim=2)
            values = torch.cat([cache.read("v", slice(None), slots), v], dim=2)
            k_pos = torch.cat([past, pos])
        o = window_parallel(q, keys, values, pos, k_pos, w)
        if cache is not None:
            keep = pos[-w:]
            cache.put(slice(None), keep % w, k[:, :, -w:], v[:, :, -w:])
        return o

    def step(self, x: torch.Tensor, state: State, layer: int) -> torch.Tensor:
        """One token per row at its own position ``state.lengths``. x ``[B, d]``."""
        b = x.shape[0]
        cache, lengths = _kv(state, layer), state.lengths
        pos = lengths.unsqueeze(1)  # [B, 1]
        q, k, v = self._qkv(x.unsqueeze(1), pos)
        rows = torch.arange(b)
        slot = lengths % self.cfg.window if self.cfg.window else lengths
        cache.put(rows, slot, k[:, :, 0], v[:, :, 0])
        every = cache.capacity
        k_l, v_l = cache.keys(slice(None), every), cache.values(slice(None), every)
        o = softmax_step(q[:, :, 0], k_l, v_l, cache.slots_used(lengths + 1))  # [B, H, C, D]
        return self.out(o.reshape(b, -1).to(x.dtype))


class MLP(nn.Module):
    """GELU feed-forward ``[..., d] -> [..., d]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x)
        if native_inference() and hidden.dtype in (torch.float32, torch.bfloat16):
            return self.down(torch.ops.linserve.gelu_tanh_(hidden.contiguous()))
        return self.down(F.gelu(hidden, approximate="tanh"))


def rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, in one native pass per row for fp32 inference (prefill), else ATen's."""
    if native_inference() and x.dtype == torch.float32 and norm.eps is None \
            and norm.weight.dtype == torch.float32:
        return torch.ops.linserve.rms_norm_rows(x.contiguous(), norm.weight,
                                               torch.finfo(torch.float32).eps)
    return norm(x)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.attn: LinearAttention | SoftmaxAttention = (
            LinearAttention(cfg) if cfg.is_recurrent else SoftmaxAttention(cfg))
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, state: State | None,
                layer: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``lengths``: right-padded rows (recurrent attention only; see LinearAttention)."""
        if lengths is None:
            attn = self.attn(rms_norm(self.norm1, x), state, layer)
        else:
            assert isinstance(self.attn, LinearAttention)
            attn = self.attn(rms_norm(self.norm1, x), state, layer, lengths)
        x = x + self.drop(attn)
        return x + self.drop(self.mlp(rms_norm(self.norm2, x)))

    def step(self, x: torch.Tensor, state: State, layer: int) -> torch.Tensor:
        x = x + self.attn.step(self.norm1(x), state, layer)  # type: ignore[arg-type,unused-ignore]
        return x + self.mlp(self.norm2(x))
