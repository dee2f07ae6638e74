"""The whole-model native decode step of a :class:`linserve.model.layers.decoder.DecoderLM` built
from the shared layers (``linserve/model/kernels/decoder_step.cpp``): LFM2, LFM2-MoE, Granite-4.0-H
(dense or with experts) and Nemotron-H step in one call instead of ~20 dispatched operators a layer
part (an MoE layer: a router, a top-k and three products per chosen expert).

:func:`plan` describes a model to the kernel: per layer its norms and two parts (mixer, MLP),
each a kind code, its weights (the very packed GEMM tensors the eager forms use, so nothing
is held twice) and its parameters. A model with any layer the kernel does not implement
(Falcon-H1's parallel block, biases, multipliers on projections) gets None and
steps layer by layer. The eager step is the reference the native one is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from linserve.model import packing
from linserve.model.layers.attention import Attention
from linserve.model.layers.block import LayerPart
from linserve.model.layers.gated_delta import DeltaMixer
from linserve.model.layers.kimi_delta import KimiDeltaAttention
from linserve.model.layers.lightning import LightningAttention
from linserve.model.layers.mamba2 import Mamba2
from linserve.model.layers.mla import LatentAttention
from linserve.model.layers.mlp import ReluSquaredMLP, SwiGLU
from linserve.model.layers.moe import SparseMoE
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.short_conv import ShortConv
from linserve.model.state import ConvEntry, KVEntry, RecurrentEntry, State
from linserve.model.verify import Trail

(ATTENTION, SHORT_CONV, MAMBA2, SWIGLU, RELU_SQUARED, EXPERTS, KDA, MLA, LIGHTNING,
 GATED_DELTA) = range(1, 11)
PART_INTS = 3  # ints a part takes after its kind and its weights' count
EMPTY = torch.empty(0)


@dataclass
class Part:
    """One part of a layer as the kernel takes it: a kind, its weights (as many as the kind
    takes), up to three ints and three floats (their meaning per kind: decoder_step.cpp's header),
    and for experts, each expert's (gate_up, down) GEMM weights, in order."""

    kind: int
    weights: list[torch.Tensor]
    ints: tuple[int, ...] = ()
    floats: tuple[float, float, float] = (0.0, 0.0, 0.0)
    experts: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Plan:
    """The kernel's arguments that do not change from step to step."""

    weights: list[torch.Tensor]
    ints: list[int]
    floats: list[float]
    dims: list[int]
    scalars: list[float]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    experts: list[torch.Tensor] = field(default_factory=list)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _attention(m: Attention) -> tuple[Part, tuple[int, ...]] | None:
    """Attention: qkv, the q / k norms (per head, or over all heads), o, the rotary
    frequencies, the head gate; a sliding window's ring by its W."""
    s = m.shape
    if s.bias or s.out_bias or s.head_dim % 16 or s.out_dim is not None:
        return None
    norms = [m.q_norm.scale().contiguous(), m.k_norm.scale().contiguous()] if s.qk_norm \
        else [EMPTY, EMPTY]
    eps = float(m.q_norm.eps) if s.qk_norm else 0.0
    freqs = EMPTY if m.freqs is None else m.freqs.contiguous()
    gate = packing.packed(m.g_proj) if s.head_gate else EMPTY
    part = Part(ATTENTION, [m.qkv_weight(), *norms, packing.packed(m.o_proj), freqs, gate],
                ints=(int(s.qk_norm and s.qk_norm_whole), s.window),
                floats=(m.q_scale, s.key_multiplier, eps))
    return part, (s.heads, s.kv_heads, s.head_dim, 0)  # rot: each part's inv_freq's


def _short_conv(m: ShortConv) -> tuple[Part, tuple[int, ...]] | None:
    if m.conv.bias is not None or m.in_proj.bias is not None:
        return None
    return Part(SHORT_CONV, [packing.packed(m.in_proj), m.conv_weight(),
                             packing.packed(m.out_proj)]), ()


def _mamba2(m: Mamba2) -> tuple[Part, tuple[int, ...]] | None:
    s = m.shape
    if s.proj_bias or s.in_multiplier != 1.0 or s.proj_multipliers is not None:
        return None
    bias = EMPTY if m.conv1d.bias is None else _f32(m.conv1d.bias)
    norm = _f32(m.norm.weight) if s.gated_norm else EMPTY
    eps = float(m.norm.eps) if s.gated_norm else 0.0
    part = Part(MAMBA2, [packing.packed(m.in_proj), m.conv_weight(), bias, _f32(m.A_log),
                         _f32(m.dt_bias), _f32(m.D), norm, packing.packed(m.out_proj)],
                ints=(int(s.norm_before_gate), int(s.gated_norm)),
                floats=(float(s.dt_limit[0]), float(s.dt_limit[1]), eps))
    return part, (s.heads, s.head_dim, s.d_state, s.groups)


def _kda(m: KimiDeltaAttention) -> tuple[Part, tuple[int, ...]] | None:
    """Kimi Delta Attention: q, k, v, the conv kernels ``[K, 3W]``, the forget gate's two
    projections (or Ling's one, after an empty slot), the output gate's likewise, b, the
    parameters (A_log per head, dt_bias, the output norm) in one fp32 tensor, o."""
    s = m.shape
    kernel = torch.cat([c.weight for c in (m.q_conv1d, m.k_conv1d, m.v_conv1d)])
    gates = ([packing.packed(m.f_a_proj), packing.packed(m.f_b_proj),
              packing.packed(m.g_a_proj), packing.packed(m.g_b_proj)] if s.low_rank_gates
             else [EMPTY, packing.packed(m.f_proj), EMPTY, packing.packed(m.g_proj)])
    params = torch.cat([_f32(m.A_log).flatten(), _f32(m.dt_bias), m.o_norm.scale().float()])
    weights = [packing.packed(m.q_proj), packing.packed(m.k_proj),
               packing.packed(m.v_proj), _f32(kernel.squeeze(1).t()), *gates,
               packing.packed(m.b_proj), params.contiguous(), packing.packed(m.o_proj)]
    safe = s.safe_lower is not None
    return Part(KDA, weights, ints=(s.heads, s.head_dim, int(safe)),
                floats=(float(m.o_norm.eps), float(s.safe_lower or 0.0), 0.0)), ()


def _mla(m: LatentAttention) -> tuple[Part, tuple[int, ...]] | None:
    """Multi-head latent attention: q (through its low rank and norm where the checkpoint
    has one), kv_a and the latent's norm, the absorbed W_kb and W_vbᵀ, o, the head gate,
    the rotary frequencies (empty: no positions)."""
    s = m.mla
    if s.bias:
        return None
    q = ([packing.packed(m.q_a_proj), m.q_a_layernorm.scale().contiguous(),
          packing.packed(m.q_b_proj)] if s.q_lora_rank
         else [EMPTY, EMPTY, packing.packed(m.q_proj)])
    kb, vb = m.absorbed()
    freqs = EMPTY if m.rope_freqs is None else m.rope_freqs.float().contiguous()
    gate = packing.packed(m.g_proj) if s.head_gate else EMPTY
    return Part(MLA, [*q, packing.packed(m.kv_a_proj_with_mqa),
                      m.kv_a_layernorm.scale().contiguous(), kb, vb,
                      packing.packed(m.o_proj), gate, freqs], ints=(s.rope_dim,)), ()


def _lightning(m: LightningAttention) -> tuple[Part, tuple[int, ...]] | None:
    """Lightning attention: qkv, the output gate, the norm over all heads, out, each head's
    log-rate."""
    if type(m.norm) is not RMSNorm:
        return None
    return Part(LIGHTNING, [packing.packed(m.qkv_proj), packing.packed(m.output_gate),
                            m.norm.scale().contiguous(), packing.packed(m.out_proj),
                            _f32(m.log_rate)],
                ints=(m.heads, m.head_dim), floats=(float(m.norm.eps), 0.0, 0.0)), ()


def _gated_delta(m: DeltaMixer) -> tuple[Part, tuple[int, ...]] | None:
    """Gated DeltaNet: the four input projections as one weight, the conv kernels
    ``[K, C]``, A_log, dt_bias, the gated norm, out."""
    d = m.delta
    sh = d.shape
    return Part(GATED_DELTA, [d.in_weight(), d.conv_weight(), _f32(d.A_log), _f32(d.dt_bias),
                              _f32(d.norm.weight), packing.packed(d.out_proj)],
                ints=(sh.key_heads, sh.head_k_dim),
                floats=(float(sh.eps), float(sh.beta_scale), 0.0)), ()


def _mlp(kind: int) -> Callable[[SwiGLU | ReluSquaredMLP], tuple[Part, tuple[int, ...]] | None]:
    """The describer of a dense MLP of ``kind`` (SWIGLU or RELU_SQUARED): its two GEMM
    weights and its hidden size."""
    def describe(m: SwiGLU | ReluSquaredMLP) -> tuple[Part, tuple[int, ...]] | None:
        weights = m.native_weights()
        if weights is None:
            return None
        return Part(kind, weights, ints=(m.down_proj.in_features, 0)), ()
    return describe


def describe_experts(m: SparseMoE) -> tuple[Part, tuple[int, ...]] | None:
    """The router, the shared expert and the latent projections in the slots, the experts
    beside them (:meth:`SparseMoE.native_args`); ``ints[0]`` (where the layer's experts
    start in the plan's list) is set by :func:`plan`; ``ints[2]``: moe.h's Router in bits.
    Qwen's whole-model step (``qwen35_step.cpp``) takes the same part (its first five
    slots: Qwen has no latent experts)."""
    args = m.native_args()
    if args is None:
        return None
    weights = args.weights if m.form.latent else args.weights[:5]
    return Part(EXPERTS, weights, ints=(0, args.top_k, args.flags),
                floats=(args.norm_eps, args.scaling, 0.0), experts=args.experts), ()


DESCRIBE: dict[type, Any] = {Attention: _attention, ShortConv: _short_conv, Mamba2: _mamba2,
                             KimiDeltaAttention: _kda, LatentAttention: _mla,
                             LightningAttention: _lightning, DeltaMixer: _gated_delta,
                             SwiGLU: _mlp(SWIGLU), ReluSquaredMLP: _mlp(RELU_SQUARED),
                             SparseMoE: describe_experts}
SHAPE_OF = {ATTENTION: "attention", MAMBA2: "mamba2"}


def _norm(norm: nn.Module | None) -> tuple[torch.Tensor, float] | None:
    """A part's norm as the kernel takes it (empty: none); None if not an RMSNorm."""
    if norm is None:
        return EMPTY, 0.0
    if type(norm) is not RMSNorm:
        return None
    return norm.scale().contiguous(), float(norm.eps)


def _part(layer_part: LayerPart, out: Plan
          ) -> tuple[list[torch.Tensor], list[int], list[float]] | None:
    """A layer part's slots (its norms before and after, then its weights; none for an
    absent part), ints (kind, the weights' count, the residual's base, then the kind's) and
    floats (the norms' eps, the residual's a and b, then the kind's); None if the kernel
    cannot run it. Records the part's shape in ``out.shapes`` (one per kind) and appends its
    experts to ``out.experts``."""
    module = layer_part.module
    if module is None:
        return [], [0] * (3 + PART_INTS), [0.0] * 7
    describe = DESCRIBE.get(type(module))
    pre, post = _norm(layer_part.pre), _norm(layer_part.post)
    if describe is None or pre is None or post is None:
        return None
    found = describe(module)
    if found is None:
        return None
    part, shape = found
    name = SHAPE_OF.get(part.kind)
    if name is not None and out.shapes.setdefault(name, shape) != shape:
        return None  # one shape per kind: the kernel takes them as dims
    ints = list(part.ints) + [0] * (PART_INTS - len(part.ints))
    if part.experts:
        ints[0] = len(out.experts)
        out.experts += part.experts
    return ([pre[0], post[0], *part.weights],
            [part.kind, len(part.weights), int(layer_part.from_normed), *ints],
            [pre[1], post[1], layer_part.a, layer_part.b, *part.floats])


def plan(model: Any) -> Plan | None:
    """The kernel's arguments for ``model`` (a DecoderLM), or None if a layer is not one the
    kernel implements."""
    if type(model.model.norm) is not RMSNorm or model.logits_soft_cap is not None:
        return None
    emb = model.model.embed_tokens
    head = packing.gemm_weight(emb, emb.weight) if model.lm_head is None \
        else packing.packed(model.lm_head)
    out = Plan([packing.embedding_table(emb), head, model.model.norm.scale().contiguous()],
               [], [], [], [])
    for layer in model.model.layers:
        native_parts = getattr(layer, "native_parts", None)
        if native_parts is None:
            return None
        described = [_part(part, out) for part in native_parts()]
        if any(d is None for d in described):
            return None
        for found in described:
            assert found is not None
            slots, ints, floats = found
            out.weights += slots
            out.ints += ints
            out.floats += floats
    attn = out.shapes.get("attention", (1, 1, 16, 0))
    out.dims = [emb.embedding_dim, *attn, *out.shapes.get("mamba2", (1, 1, 1, 1))]
    out.scalars = [float(model.model.norm.eps), float(model.embedding_scale),
                   float(model.logits_scaling)]
    return out


def state_tensors(state: State) -> list[torch.Tensor] | None:
    """Each layer's two state tensors as the kernel takes them (None: a layout it does not
    take)."""
    out: list[torch.Tensor] = []
    for entries in state.layers:
        kv, rec, conv = entries.get("kv"), entries.get("recurrent"), entries.get("conv")
        if isinstance(kv, KVEntry):
            out += [kv.k, kv.v]
        elif isinstance(rec, RecurrentEntry) and isinstance(conv, ConvEntry):
            out += [rec.s, conv.window]
        elif isinstance(conv, ConvEntry) and len(entries) == 1:
            out += [conv.window, EMPTY]
        elif isinstance(rec, RecurrentEntry) and len(entries) == 1 and rec.z is None:
            out += [rec.s, EMPTY]
        elif not entries:
            out += [EMPTY, EMPTY]
        else:
            return None
    return out if all(t.is_contiguous() for t in out) else None


def step(p: Plan, tokens: torch.Tensor, state: State) -> torch.Tensor | None:
    """One native step (tokens ``[B]`` -> logits ``[B, V]``, the state advanced in place but
    for its lengths), or None if the state's tensors are not laid out for it."""
    tensors = state_tensors(state)
    if tensors is None:
        return None
    return torch.ops.linserve.decoder_step(tokens.contiguous(), p.weights, p.experts, tensors,
                                           state.lengths, p.ints, p.floats, p.dims, p.scalars)


def verify(p: Plan, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, Trail] | None:
    """A native verify (tokens ``[B, T]`` -> logits ``[B, T, V]`` and the trail, the state
    advanced by all T in place but for its lengths), or None as :func:`step` and where a
    sliding window's ring holds keys (the caller then verifies by steps)."""
    tensors = state_tensors(state)
    if tensors is None or any(e.window for e in state.kv_entries):
        return None  # a ring overwrites keys a rejected draft's rollback would need
    b, t = tokens.shape
    recurrent = [not any(isinstance(e, KVEntry) for e in entries.values())
                 for entries in state.layers]
    snaps = [torch.empty(t - 1, *x.shape) if t > 1 and x.numel() and recurrent[i // 2]
             else EMPTY for i, x in enumerate(tensors)]
    logits = torch.ops.linserve.decoder_verify(
        tokens.t().contiguous().flatten(), p.weights, p.experts, tensors, snaps, state.lengths,
        p.ints, p.floats, p.dims, p.scalars, t)
    kept = [x for x in snaps if x.numel()]
    return logits.view(t, b, -1).transpose(0, 1), Trail([[x[i] for x in kept]
                                                         for i in range(t - 1)])
