"""The fused decode step: a model's whole ``step`` in one native call.

:class:`FusedStep` packs a model's weights once into the flat list the kernel takes and calls
it: ``linserve/model/kernels/linear_step.cpp`` for elu+1 linear attention (gated or not), and
``linserve/model/kernels/softmax_step.cpp`` for the softmax baselines (full or sliding-window KV
cache). It computes what the eager :meth:`linserve.model.architectures.own_model.LanguageModel.step`
computes, with activations in fp32 between the GEMMs; the eager step stays the reference (and the
fallback for ``favor`` and machines without a C++ compiler). Tests hold the two within 1e-5
in fp32.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from linserve.model import kernels, packing
from linserve.model.layers.own import Block
from linserve.model.own_config import EAGER_ONLY_FIELDS, ModelConfig
from linserve.model.state import ConvEntry, KVEntry, RecurrentEntry, State


class Fusable(Protocol):
    """What the fused step packs: a model's config, embedding, final norm and blocks
    (:class:`linserve.model.architectures.own_model.LanguageModel` is one; naming it here
    would close an import circle, since the model builds its fused step)."""

    cfg: ModelConfig
    embed: torch.nn.Embedding
    norm: torch.nn.RMSNorm
    layers: list[Block]
    kv_dtype: str  # what its KV caches hold



def supports(model: Fusable) -> bool:
    """The kernels cover elu+1 linear attention (gated or not) and softmax attention (full or
    windowed, over an fp32 cache), with RMSNorm eps left at its default."""
    eager_only = any(getattr(model.cfg, f) for f in EAGER_ONLY_FIELDS)
    if model.cfg.attention == "softmax" and model.kv_dtype != "fp32":
        return False  # its kernel reads an fp32 cache; a bf16 / int8 one steps eagerly
    return model.cfg.attention in ("linear", "softmax") and not eager_only and all(
        n.eps is None for n in (model.norm, *(b.norm1 for b in model.layers),
                                *(b.norm2 for b in model.layers)))


class FusedStep:
    """Packed weights plus the kernel call. Rebuild it after changing the model's weights or
    dtype (``LanguageModel.set_fused_step`` does)."""

    def __init__(self, model: Fusable) -> None:
        if not supports(model):
            raise ValueError("the fused step supports attention='linear' or 'softmax' only")
        if not kernels.load():
            raise RuntimeError(f"native kernels unavailable: {kernels.load_error()}")
        self.softmax = not model.cfg.is_recurrent
        self.heads = model.cfg.n_heads
        self.attn_eps = model.cfg.eps
        self.window = model.cfg.window
        self.rope_base = model.cfg.rope_base
        # nn.RMSNorm(eps=None) uses the epsilon of its compute type, fp32 even for bf16 input.
        self.norm_eps = torch.finfo(torch.float32).eps
        self.weights = self._pack(model)

    @staticmethod
    def _pack(model: Fusable) -> list[torch.Tensor]:
        """[embed, head, final norm, then per layer: norm1, qkv (+ gate_down), conv [K, 3d],
        out, norm2, up, down, gate_up [r, d], gate_bias [d]]. Norm, conv and gate_up weights
        are fp32; GEMM weights keep the model dtype and are stored transposed, ``[in, out]``
        and contiguous (the GEMM runs faster on that layout). A gated model's gate_down
        [d, r] is appended to the qkv weight as r extra output columns. GEMM weights then take
        the layout the batch-invariant GEMM streams, in that mode (:func:`packing.pack`)."""
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().contiguous()

        def gemm(linear: torch.nn.Linear) -> torch.Tensor:
            return packing.pack(linear.weight.detach().t())

        emb = model.embed.weight.detach()
        packed = [emb, packing.pack(emb.t()), f32(model.norm.weight)]
        if not model.cfg.is_recurrent:  # softmax: norm1, qkv, out, norm2, up, down
            for block in model.layers:
                packed += [f32(block.norm1.weight), gemm(block.attn.qkv), gemm(block.attn.out),
                           f32(block.norm2.weight), gemm(block.mlp.up), gemm(block.mlp.down)]
            return packed
        for block in model.layers:
            attn = block.attn
            conv = getattr(attn, "conv", None)
            down, up = getattr(attn, "gate_down", None), getattr(attn, "gate_up", None)
            qkv = attn.qkv.weight.detach().t()
            gate = [torch.empty(0), torch.empty(0)]
            if down is not None and up is not None:
                qkv = torch.cat([qkv, down.weight.detach().t()], dim=1)
                gate = [f32(up.weight.t()), f32(up.bias)]
            packed += [
                f32(block.norm1.weight), packing.pack(qkv),
                f32(conv.T) if conv is not None else torch.empty(0),
                gemm(attn.out), f32(block.norm2.weight), gemm(block.mlp.up),
                gemm(block.mlp.down), *gate]
        return packed

    def __call__(self, tokens: torch.Tensor, state: State,
                 with_head: bool = True) -> torch.Tensor:
        """tokens ``[B]`` -> logits ``[B, V]`` fp32; advances ``state`` (B rows) in place.
        ``with_head=False`` returns the last layer's output ``[B, d]`` instead (benchmarks
        time the layers and the LM head apart this way). A KV cache gets its slot first and
        its lengths advanced after, as the eager step does."""
        if self.softmax:
            state.reserve(int(state.lengths.max()) + 1)
            k, v = self._lists(state)
            out = torch.ops.linserve.softmax_step(
                tokens, self.weights, k, v, state.lengths, self.heads, self.window,
                self.rope_base, self.norm_eps, with_head)
        else:
            s, z, conv = self._lists(state)
            out = torch.ops.linserve.linear_step(
                tokens, self.weights, s, z, conv, state.lengths, self.heads, self.attn_eps,
                self.norm_eps, with_head)
        return out  # the kernels advanced state.lengths

    def _lists(self, state: State) -> list[list[torch.Tensor]]:
        """The per-layer tensors the kernel takes: k and v, or s, z and conv."""
        if self.softmax:
            kv = [cast(KVEntry, layer["kv"]) for layer in state.layers]
            return [[e.k for e in kv], [e.v for e in kv]]
        rec = [cast(RecurrentEntry, layer["recurrent"]) for layer in state.layers]
        return [[e.s for e in rec], [cast(torch.Tensor, e.z) for e in rec],
                [cast(ConvEntry, layer["conv"]).window for layer in state.layers]]
