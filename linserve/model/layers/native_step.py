"""The whole-model native decode step of a :class:`linserve.model.layers.decoder.DecoderLM`
(``linserve/model/kernels/decoder_step.cpp``): every family built from the shared layers, and
Qwen3.5 / Qwen3-Next, step in one call instead of ~20 dispatched operators a layer part (an
MoE layer: a router, a top-k and three products per chosen expert).

:func:`plan` describes a model to the kernel: per layer part a :class:`step_parts.Residual`
(its norms and residual factors) and a typed body (:mod:`linserve.model.layers.step_parts`),
whose weights are the very packed GEMM tensors the eager forms use, so nothing is held
twice. A module describes itself with a ``native_part()`` method, or through
:data:`DESCRIBE` for the shared layers. A model with any part the kernel does not implement
(Falcon-H1's parallel block, biases, multipliers on projections) gets None and steps layer
by layer. The eager step is the reference the native one is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from linserve.model import packing
from linserve.model.layers.attention import Attention
from linserve.model.layers.block import LayerPart
from linserve.model.layers.gated_delta import DeltaMixer, GatedDeltaNet
from linserve.model.layers.kimi_delta import KimiDeltaAttention
from linserve.model.layers.lightning import LightningAttention
from linserve.model.layers.mamba2 import Mamba2
from linserve.model.layers.mla import LatentAttention
from linserve.model.layers.mlp import ReluSquaredMLP, SwiGLU
from linserve.model.layers.moe import SparseMoE
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.short_conv import ShortConv
from linserve.model.layers.step_parts import (
    EMPTY,
    AttentionPart,
    ExpertsPart,
    GatedDeltaPart,
    KdaPart,
    LightningPart,
    Mamba2Part,
    MlaPart,
    MtpPrologue,
    NativePart,
    Records,
    ReluSquaredPart,
    Residual,
    ShortConvPart,
    SwiGLUPart,
)
from linserve.model.state import ConvEntry, KVEntry, PositionEntry, RecurrentEntry, State
from linserve.model.verify import Trail


@dataclass
class Plan:
    """A built ``DecoderPlan`` (the kernel's model, checked once) and what the Python side
    needs beside it: the hidden size, each layer's count of state tensors, and per state
    tensor whether a verify snapshots it."""

    handle: Any
    weights: list[torch.Tensor]  # every tensor it reads: embed, head, norm, parts', experts
    width: int  # d
    layer_states: list[int]
    recurrent: list[bool]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _attention(m: Attention) -> NativePart | None:
    s = m.shape
    if s.bias or s.out_bias or s.head_dim % 16 or s.out_dim is not None:
        return None
    return AttentionPart(
        qkv=m.qkv_weight(),
        q_norm=m.q_norm.scale().contiguous() if s.qk_norm else EMPTY,
        k_norm=m.k_norm.scale().contiguous() if s.qk_norm else EMPTY,
        o=packing.packed(m.o_proj), inv_freq=EMPTY if m.freqs is None else m.freqs.contiguous(),
        gate=packing.packed(m.g_proj) if s.head_gate else EMPTY,
        heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
        norm_whole=bool(s.qk_norm and s.qk_norm_whole), window=s.window, gate_interleaved=False,
        q_scale=m.q_scale, key_multiplier=s.key_multiplier,
        norm_eps=float(m.q_norm.eps) if s.qk_norm else 0.0)


def _short_conv(m: ShortConv) -> NativePart | None:
    if m.conv.bias is not None or m.in_proj.bias is not None:
        return None
    return ShortConvPart(packing.packed(m.in_proj), m.conv_weight(), packing.packed(m.out_proj))


def _mamba2(m: Mamba2) -> NativePart | None:
    s = m.shape
    if s.proj_bias or s.in_multiplier != 1.0 or s.proj_multipliers is not None:
        return None
    return Mamba2Part(
        packing.packed(m.in_proj), m.conv_weight(),
        EMPTY if m.conv1d.bias is None else _f32(m.conv1d.bias), _f32(m.A_log),
        _f32(m.dt_bias), _f32(m.D), _f32(m.norm.weight) if s.gated_norm else EMPTY,
        packing.packed(m.out_proj), s.heads, s.head_dim, s.d_state, s.groups,
        s.norm_before_gate, s.gated_norm, float(s.dt_limit[0]), float(s.dt_limit[1]),
        float(m.norm.eps) if s.gated_norm else 0.0)


def _kda(m: KimiDeltaAttention) -> NativePart | None:
    s = m.shape
    kernel = torch.cat([c.weight for c in (m.q_conv1d, m.k_conv1d, m.v_conv1d)])
    low = s.low_rank_gates  # Kimi's bottlenecks; Ling's direct f and g after empty slots
    params = torch.cat([_f32(m.A_log).flatten(), _f32(m.dt_bias), m.o_norm.scale().float()])
    return KdaPart(
        q=packing.packed(m.q_proj), k=packing.packed(m.k_proj), v=packing.packed(m.v_proj),
        conv=_f32(kernel.squeeze(1).t()),
        f_a=packing.packed(m.f_a_proj) if low else EMPTY,
        f_b=packing.packed(m.f_b_proj if low else m.f_proj),
        g_a=packing.packed(m.g_a_proj) if low else EMPTY,
        g_b=packing.packed(m.g_b_proj if low else m.g_proj),
        b=packing.packed(m.b_proj), params=params.contiguous(), o=packing.packed(m.o_proj),
        heads=s.heads, head_dim=s.head_dim, safe_gate=s.safe_lower is not None,
        norm_eps=float(m.o_norm.eps), safe_lower=float(s.safe_lower or 0.0))


def _mla(m: LatentAttention) -> NativePart | None:
    s = m.mla
    if s.bias:
        return None
    low = bool(s.q_lora_rank)
    kb, vb = m.absorbed()
    return MlaPart(
        q_a=packing.packed(m.q_a_proj) if low else EMPTY,
        q_a_norm=m.q_a_layernorm.scale().contiguous() if low else EMPTY,
        q_b=packing.packed(m.q_b_proj if low else m.q_proj),
        kv_a=packing.packed(m.kv_a_proj_with_mqa),
        kv_norm=m.kv_a_layernorm.scale().contiguous(), kb=kb, vb=vb, o=packing.packed(m.o_proj),
        gate=packing.packed(m.g_proj) if s.head_gate else EMPTY,
        inv_freq=EMPTY if m.rope_freqs is None else m.rope_freqs.float().contiguous(),
        rope_dim=s.rope_dim)


def _lightning(m: LightningAttention) -> NativePart | None:
    if type(m.norm) is not RMSNorm:
        return None
    return LightningPart(packing.packed(m.qkv_proj), packing.packed(m.output_gate),
                         m.norm.scale().contiguous(), packing.packed(m.out_proj),
                         _f32(m.log_rate), m.heads, m.head_dim, float(m.norm.eps))


def gated_delta_part(d: GatedDeltaNet) -> NativePart:
    """A Gated DeltaNet layer (OLMo-Hybrid's inside a :class:`DeltaMixer`, Qwen3.5's
    itself)."""
    sh = d.shape
    return GatedDeltaPart(d.in_weight(), d.conv_weight(), _f32(d.A_log), _f32(d.dt_bias),
                          _f32(d.norm.weight), packing.packed(d.out_proj), sh.key_heads,
                          sh.head_k_dim, float(sh.eps), float(sh.beta_scale))


def _swiglu(m: SwiGLU) -> NativePart | None:
    weights = m.native_weights()
    return None if weights is None else SwiGLUPart(*weights)


def _relu_squared(m: ReluSquaredMLP) -> NativePart | None:
    weights = m.native_weights()
    return None if weights is None else ReluSquaredPart(*weights)


def experts_part(m: SparseMoE) -> NativePart | None:
    """The router, the shared expert and the latent projections in the slots, the experts
    beside them (:meth:`SparseMoE.native_args`); ``first`` is set by :func:`plan`."""
    args = m.native_args()
    if args is None:
        return None
    router, bias, shared_up, shared_down, shared_gate, latent_in, latent_out = args.weights
    return ExpertsPart(router, bias, shared_up, shared_down, shared_gate, latent_in,
                       latent_out, first=0, top_k=args.top_k, router_bits=args.flags,
                       norm_eps=args.norm_eps, scaling=args.scaling, experts=args.experts)


DESCRIBE: dict[type, Callable[[Any], NativePart | None]] = {
    Attention: _attention, ShortConv: _short_conv, Mamba2: _mamba2, KimiDeltaAttention: _kda,
    LatentAttention: _mla, LightningAttention: _lightning,
    DeltaMixer: lambda m: gated_delta_part(m.delta), GatedDeltaNet: gated_delta_part,
    SwiGLU: _swiglu, ReluSquaredMLP: _relu_squared, SparseMoE: experts_part}


def describe(module: nn.Module) -> NativePart | None:
    """The native part of one module: its own ``native_part()``, or :data:`DESCRIBE`'s;
    None if the kernel does not implement it."""
    own = getattr(module, "native_part", None)
    if callable(own):
        found: NativePart | None = own()
        return found
    describer = DESCRIBE.get(type(module))
    return None if describer is None else describer(module)


def norm_tensors(norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """A norm as the kernel takes it: its scale, its bias (empty for an RMSNorm) and eps
    (empty: no norm); None for another kind of norm, or a LayerNorm without a bias."""
    if norm is None:
        return EMPTY, EMPTY, 0.0
    if type(norm) is RMSNorm:
        return norm.scale().contiguous(), EMPTY, float(norm.eps)
    if type(norm) is nn.LayerNorm and norm.bias is not None:
        return _f32(norm.weight), _f32(norm.bias), float(norm.eps)
    return None


def _part(layer_part: LayerPart) -> tuple[Residual, NativePart] | None:
    """A present layer part's residual and body; None if the kernel cannot run it."""
    assert layer_part.module is not None
    pre, post = norm_tensors(layer_part.pre), norm_tensors(layer_part.post)
    body = describe(layer_part.module)
    if body is None or pre is None or post is None:
        return None
    kinds = {type(n) for n in (layer_part.pre, layer_part.post) if n is not None}
    if len(kinds) > 1:
        return None  # one kind of norm a part
    return Residual(pre[0], post[0], pre[1], post[1], layer_part.from_normed,
                    nn.LayerNorm in kinds, pre[2], post[2], layer_part.a, layer_part.b), body


def _layers(layers: list[nn.Module], records: Records, experts: list[torch.Tensor]
            ) -> list[int] | None:
    """Every layer's parts into ``records`` (their experts into ``experts``); each layer's
    count of state tensors, or None if a part is not one the kernel implements."""
    counts: list[int] = []
    for layer in layers:
        native_parts = getattr(layer, "native_parts", None)
        if native_parts is None:
            return None
        found = [_part(p) for p in native_parts() if p.module is not None]
        if any(f is None for f in found):
            return None
        count = 0
        for f in found:
            assert f is not None
            residual, body = f
            if isinstance(body, ExpertsPart):
                body.first = len(experts)
                experts += body.experts
            records.add(residual)
            records.add(body)
            count += body.STATE
        counts.append(count)
    return counts


def build(head: list[torch.Tensor], scalars: list[float], layers: list[nn.Module],
          prologue: MtpPrologue | None = None) -> Plan | None:
    """A plan of ``layers`` (each with ``native_parts()``) under ``head`` (embed, head, final
    norm, its bias: empty for an RMSNorm) and ``scalars`` (the final norm's eps, the
    embedding scale, the logits' divisor, their soft cap or 0), after ``prologue`` (an MTP
    head's); None as :func:`plan`."""
    records, experts = Records(), list[torch.Tensor]()
    if prologue is not None:
        records.add(prologue)
    counts = _layers(layers, records, experts)
    if counts is None:
        return None
    handle = torch.classes.linserve.DecoderPlan(
        head, scalars, records.kinds, records.fields, records.tensors, records.ints,
        records.floats, experts)
    assert handle.state_count() == sum(counts), "step_parts.py and step_parts.h disagree"
    return Plan(handle, [*head, *records.tensors, *experts], int(head[2].shape[0]), counts,
                [bool(r) for r in handle.recurrent_states()])


def plan(model: Any) -> Plan | None:
    """The kernel's model for ``model`` (a DecoderLM), or None if a layer is not one the
    kernel implements."""
    final = norm_tensors(model.model.norm)
    if final is None:
        return None
    return build([*head_tensors(model), final[0], final[1]],
                 [final[2], float(model.embedding_scale), float(model.logits_scaling),
                  float(model.logits_soft_cap or 0.0)], list(model.model.layers))


def head_tensors(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A DecoderLM's embedding table and head as the kernel reads them (a tied head is the
    table's GEMM weight)."""
    emb = model.model.embed_tokens
    head = packing.gemm_weight(emb, emb.weight) if model.lm_head is None \
        else packing.packed(model.lm_head)
    return packing.embedding_table(emb), head


ENTRY_ORDER = ("kv", "recurrent", "conv")


def _entry_order(name: str) -> int:
    """Where a layer's entry comes in its state tensors: kv, recurrent, conv, then others
    (RWKV's ``ffn`` shift) in the order the layer made them (a stable sort)."""
    return ENTRY_ORDER.index(name) if name in ENTRY_ORDER else len(ENTRY_ORDER)


def state_tensors(p: Plan, state: State) -> list[torch.Tensor] | None:
    """Each layer's state tensors as the kernel takes them: a KV entry's k and v, a
    recurrent entry's S, a conv entry's window, in :func:`_entry_order` (None: a layout it
    does not take)."""
    out: list[torch.Tensor] = []
    for count, entries in zip(p.layer_states, state.layers, strict=True):
        tensors: list[torch.Tensor] = []
        for name in sorted(entries, key=_entry_order):
            entry = entries[name]
            if isinstance(entry, KVEntry):
                tensors += [entry.k, entry.v]
            elif isinstance(entry, RecurrentEntry) and entry.z is None:
                tensors.append(entry.s)
            elif isinstance(entry, ConvEntry):
                tensors.append(entry.window)
            elif not isinstance(entry, PositionEntry):  # offsets go beside (offsets_of)
                return None
        if len(tensors) != count:
            return None
        out += tensors
    return out if all(t.is_contiguous() for t in out) else None


def offsets_of(state: State) -> torch.Tensor | None:
    """Each row's rotary position minus its cache slot ``[B]`` (a :class:`PositionEntry`'s,
    after an image under M-RoPE), or None where the state keeps none."""
    held = next((e for e in state.entries() if isinstance(e, PositionEntry)), None)
    return None if held is None else held.offset


def step(p: Plan, tokens: torch.Tensor, state: State) -> torch.Tensor | None:
    """One native step (tokens ``[B]`` -> logits ``[B, V]``, the state advanced in place but
    for its lengths), or None if the state's tensors are not laid out for it."""
    tensors = state_tensors(p, state)
    if tensors is None:
        return None
    return torch.ops.linserve.decoder_step(p.handle, tokens.contiguous(), tensors,
                                           state.lengths, offsets_of(state))


def verify(p: Plan, tokens: torch.Tensor, state: State, hidden: bool = False
           ) -> tuple[torch.Tensor, Trail] | None:
    """A native verify (tokens ``[B, T]`` -> logits ``[B, T, V]`` and the trail, with the
    final norm's outputs where ``hidden``; the state advanced by all T in place but for its
    lengths), or None as :func:`step` and where a sliding window's ring holds keys (the
    caller then verifies by steps)."""
    tensors = state_tensors(p, state)
    if tensors is None or any(e.window for e in state.kv_entries):
        return None  # a ring overwrites keys a rejected draft's rollback would need
    b, t = tokens.shape
    snaps = [torch.empty(t - 1, *x.shape) if t > 1 and x.numel() and keep else EMPTY
             for x, keep in zip(tensors, p.recurrent, strict=True)]
    hid = torch.empty(t * b, p.width) if hidden else EMPTY
    logits = torch.ops.linserve.decoder_verify(p.handle, tokens.t().contiguous().flatten(),
                                               tensors, snaps, hid, state.lengths, t,
                                               offsets_of(state))
    kept = [x for x in snaps if x.numel()]
    trail = Trail([[x[i] for x in kept] for i in range(t - 1)],
                  hid.view(t, b, -1).transpose(0, 1) if hidden else None)
    return logits.view(t, b, -1).transpose(0, 1), trail
