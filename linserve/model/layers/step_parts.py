"""The whole-model native step's layer parts as typed records: the Python side of
``linserve/model/kernels/step_parts.h``, field for field.

Each kind of layer part is a dataclass whose fields are its weights (tensors), then its sizes
and switches (ints, bools), then its constants (floats), in the order the C++ struct of the
same ``KIND`` declares them. :class:`Records` writes a sequence of them as the native plan
takes them: a kind and its field names per record, and the values in three streams. The
plan checks each record's names against its struct when it is built (once per model), so a
field added on one side only fails there with both lists in the message.

``STATE``: the state tensors a part takes, in the order a layer's entries give them
(``native_step.state_tensors``: a KV entry's k and v, a recurrent entry's S, a conv entry's
window). Shapes: d hidden, H heads of D.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

EMPTY = torch.empty(0)


@dataclass
class NativePart:
    """A record of the native plan (subclasses name their ``KIND``)."""

    KIND: ClassVar[str]
    STATE: ClassVar[int] = 0


@dataclass
class Residual(NativePart):
    """How a part joins x: ``h = pre(x)``, ``y = post(body(h))``, ``x = a·base + b·y``
    (base x, or h with ``from_normed``); an empty norm is none."""

    KIND: ClassVar[str] = "residual"
    pre: torch.Tensor
    post: torch.Tensor
    pre_bias: torch.Tensor
    post_bias: torch.Tensor
    from_normed: bool
    layer_norm: bool  # LayerNorms with their biases (RWKV's), else RMSNorms
    pre_eps: float
    post_eps: float
    a: float
    b: float


@dataclass
class MtpPrologue(NativePart):
    """Qwen3.5's MTP head before its layer: ``x = fc([norm_embed(e), norm_hidden(h)])``."""

    KIND: ClassVar[str] = "mtp_prologue"
    norm_embed: torch.Tensor
    norm_hidden: torch.Tensor
    fc: torch.Tensor
    eps: float


@dataclass
class AttentionPart(NativePart):
    """Softmax attention over a KV cache: qkv ``[d, (H + 2·Hkv)·D]`` (``gate_interleaved``:
    per head ``[q D | gate D]``, Qwen3.5's), the q / k norms (per head, or over all heads
    with ``norm_whole``; empty: none), o, the rotary ``inv_freq`` (empty: none), a gate
    ``[d, H]`` (empty: none); ``window`` > 0: a ring of the last W keys."""

    KIND: ClassVar[str] = "attention"
    STATE: ClassVar[int] = 2
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    inv_freq: torch.Tensor
    gate: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    norm_whole: bool
    window: int
    gate_interleaved: bool
    q_scale: float
    key_multiplier: float
    norm_eps: float


@dataclass
class ShortConvPart(NativePart):
    """LFM2's short convolution: in ``[d, 3d]``, conv ``[K, d]``, out ``[d, d]``."""

    KIND: ClassVar[str] = "short_conv"
    STATE: ClassVar[int] = 1
    in_proj: torch.Tensor
    conv: torch.Tensor
    out: torch.Tensor


@dataclass
class Mamba2Part(NativePart):
    """Mamba2: in, conv ``[K, C]`` (+ bias), A_log, dt_bias, D, the gated norm (empty: y·silu(z)),
    out; H heads of P, N the state size, G groups."""

    KIND: ClassVar[str] = "mamba2"
    STATE: ClassVar[int] = 2
    in_proj: torch.Tensor
    conv: torch.Tensor
    conv_bias: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    d_skip: torch.Tensor
    norm: torch.Tensor
    out: torch.Tensor
    heads: int
    head_dim: int
    d_state: int
    groups: int
    norm_before_gate: bool
    gated_norm: bool
    dt_min: float
    dt_max: float
    norm_eps: float


@dataclass
class SwiGLUPart(NativePart):
    KIND: ClassVar[str] = "swiglu"
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class ReluSquaredPart(NativePart):
    KIND: ClassVar[str] = "relu_squared"
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class ExpertsPart(NativePart):
    """Sparse experts (moe.h): the router and shared / latent slots, the experts' own
    weights (:attr:`experts`, appended to the plan's list; ``first`` is where they start
    there), top k, the router's bits, the top-k norm's eps and the routed scaling."""

    KIND: ClassVar[str] = "experts"
    router: torch.Tensor
    bias: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor
    shared_gate: torch.Tensor
    latent_in: torch.Tensor
    latent_out: torch.Tensor
    first: int
    top_k: int
    router_bits: int
    norm_eps: float
    scaling: float
    experts: list[torch.Tensor] = field(default_factory=list, metadata={"record": False})


@dataclass
class KdaPart(NativePart):
    """Kimi Delta Attention: q, k, v, the conv kernels ``[K, 3W]``, the forget gate's two
    projections (or Ling's one after an empty slot), the output gate's likewise, b, the
    parameters (A_log per head, dt_bias, the output norm) in one fp32 tensor, o."""

    KIND: ClassVar[str] = "kda"
    STATE: ClassVar[int] = 2
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    conv: torch.Tensor
    f_a: torch.Tensor
    f_b: torch.Tensor
    g_a: torch.Tensor
    g_b: torch.Tensor
    b: torch.Tensor
    params: torch.Tensor
    o: torch.Tensor
    heads: int
    head_dim: int
    safe_gate: bool
    norm_eps: float
    safe_lower: float


@dataclass
class MlaPart(NativePart):
    """Multi-head latent attention: q (through its low rank and norm where the checkpoint
    has one), kv_a and the latent's norm, the absorbed W_kb and W_vbᵀ, o, the head gate,
    the rotary frequencies (empty: no positions)."""

    KIND: ClassVar[str] = "mla"
    STATE: ClassVar[int] = 2
    q_a: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_norm: torch.Tensor
    kb: torch.Tensor
    vb: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    inv_freq: torch.Tensor
    rope_dim: int


@dataclass
class LightningPart(NativePart):
    """Lightning attention: qkv, the output gate, the norm over all heads, out, each head's
    log-rate."""

    KIND: ClassVar[str] = "lightning"
    STATE: ClassVar[int] = 1
    qkv: torch.Tensor
    gate: torch.Tensor
    norm: torch.Tensor
    out: torch.Tensor
    log_rate: torch.Tensor
    heads: int
    head_dim: int
    norm_eps: float


@dataclass
class GatedDeltaPart(NativePart):
    """Gated DeltaNet: the four input projections as one weight, the conv kernels ``[K, C]``,
    A_log, dt_bias, the gated norm, out."""

    KIND: ClassVar[str] = "gated_delta"
    STATE: ClassVar[int] = 2
    in_proj: torch.Tensor
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out: torch.Tensor
    key_heads: int
    head_k_dim: int
    norm_eps: float
    beta_scale: float


@dataclass
class Rwkv7TimeMixPart(NativePart):
    """RWKV-7's time mix: the six lerps ``[6, d]``, r, k, v, o, each LoRA's down and up GEMM
    weights and up bias (v's empty on the first layer; g has no bias), k_k, k_a, r_k, the
    output GroupNorm; ``first`` writes v₁ to the plan's value slot ``carry``, later layers
    read it."""

    KIND: ClassVar[str] = "rwkv7_time_mix"
    STATE: ClassVar[int] = 2
    mixes: torch.Tensor
    r: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    w_down: torch.Tensor
    w_up: torch.Tensor
    w_bias: torch.Tensor
    a_down: torch.Tensor
    a_up: torch.Tensor
    a_bias: torch.Tensor
    v_down: torch.Tensor
    v_up: torch.Tensor
    v_bias: torch.Tensor
    g_down: torch.Tensor
    g_up: torch.Tensor
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor
    norm: torch.Tensor
    norm_bias: torch.Tensor
    heads: int
    head_dim: int
    first: bool
    carry: int
    group_eps: float


@dataclass
class Rwkv7ChannelMixPart(NativePart):
    KIND: ClassVar[str] = "rwkv7_channel_mix"
    STATE: ClassVar[int] = 1
    x_k: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


@dataclass
class Rwkv6TimeMixPart(NativePart):
    """RWKV-6's time mix: the shared lerp μ_x ``[d]`` and the five groups' ``[5, d]`` (w, k,
    v, r, g), the token-shift LoRA ``[d, 5 D]`` and ``[5, D, d]``, the decay w₀ ``[d]`` and
    its LoRA ``[d, R]``, ``[R, d]`` (all fp32, ``x @ W``), the bonus u ``[H, N]``, r, k, v, g,
    o (GEMM weights), the output GroupNorm."""

    KIND: ClassVar[str] = "rwkv6_time_mix"
    STATE: ClassVar[int] = 2
    maa_x: torch.Tensor
    maa: torch.Tensor
    maa_w1: torch.Tensor
    maa_w2: torch.Tensor
    decay: torch.Tensor
    decay_w1: torch.Tensor
    decay_w2: torch.Tensor
    u: torch.Tensor
    r: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    o: torch.Tensor
    norm: torch.Tensor
    norm_bias: torch.Tensor
    heads: int
    head_dim: int
    group_eps: float


@dataclass
class Rwkv4TimeMixPart(NativePart):
    """RWKV-4's time mix: the lerps ``[3, d]`` (k, v, r: ``x·μ + x₋·(1 − μ)``), the decay
    w = −exp(w₀) and the bonus u ``[A]`` fp32, k, v, r, o (GEMM weights)."""

    KIND: ClassVar[str] = "rwkv4_time_mix"
    STATE: ClassVar[int] = 2
    mix: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    r: torch.Tensor
    o: torch.Tensor


@dataclass
class RwkvGatedChannelMixPart(NativePart):
    """RWKV-4's and RWKV-6's channel mix ``σ(R x_r)·V relu(K x_k)²``: the lerps ``[2, d]``
    (k, r) in RWKV-6's form ``x + (x₋ − x)·μ`` with ``maa``, else RWKV-4's."""

    KIND: ClassVar[str] = "rwkv_gated_channel_mix"
    STATE: ClassVar[int] = 1
    mix: torch.Tensor
    key: torch.Tensor
    receptance: torch.Tensor
    value: torch.Tensor
    maa: bool


@dataclass
class MlstmPart(NativePart):
    """xLSTM's mLSTM layer: q, k, v, o and the two gates as one GEMM weight ``[d, 2·qk +
    2·v + 2H]``, the gates' biases ``[2H]``, the per-head norm's weight ``[v]``, out."""

    KIND: ClassVar[str] = "mlstm"
    STATE: ClassVar[int] = 3
    proj: torch.Tensor
    gate_bias: torch.Tensor
    norm: torch.Tensor
    out: torch.Tensor
    heads: int
    qk_dim: int
    v_dim: int
    gate_cap: float
    norm_eps: float
    eps: float


@dataclass
class Records:
    """A sequence of records as ``DecoderPlan`` takes them."""

    kinds: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)

    def add(self, part: NativePart) -> None:
        """Append ``part``: its kind, its field names, each value to its stream by the
        field's declared type."""
        names = []
        for f in dataclasses.fields(part):
            if not f.metadata.get("record", True):
                continue
            names.append(f.name)
            value = getattr(part, f.name)
            if f.type == "torch.Tensor":
                self.tensors.append(value)
            elif f.type in ("int", "bool"):
                self.ints.append(int(value))
            elif f.type == "float":
                self.floats.append(float(value))
            else:
                raise TypeError(f"{type(part).__name__}.{f.name}: a field of type {f.type}")
        self.kinds.append(part.KIND)
        self.fields.append(" ".join(names))
