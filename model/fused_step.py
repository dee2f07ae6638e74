"""The fused decode step: the whole RNN-mode ``step`` of an elu+1 model in one native call.

:class:`FusedStep` packs a model's weights once into the flat list the kernel takes
(``model/kernels/linear_step.cpp``) and calls it. It computes what the eager
:meth:`model.transformer.LanguageModel.step` computes, with activations in fp32 between the
GEMMs; the eager step stays the reference (and the fallback for ``favor``, ``softmax`` and
machines without a C++ compiler). Tests hold the two within 1e-5 in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model import kernels
from model.state import LinearState

if TYPE_CHECKING:
    from model.transformer import LanguageModel


def supports(model: LanguageModel) -> bool:
    """The kernel covers elu+1 linear attention, gated or not, with RMSNorm eps left at its
    default and a gate over head_dim features."""
    return model.cfg.attention == "linear" and all(
        n.eps is None for n in (model.norm, *(b.norm1 for b in model.layers),
                                *(b.norm2 for b in model.layers)))


class FusedStep:
    """Packed weights plus the kernel call. Rebuild it after changing the model's weights or
    dtype (``LanguageModel.set_fused_step`` does)."""

    def __init__(self, model: LanguageModel) -> None:
        if not supports(model):
            raise ValueError("the fused step supports attention='linear' only")
        if not kernels.load():
            raise RuntimeError(f"native kernels unavailable: {kernels.load_error()}")
        self.heads = model.cfg.n_heads
        self.attn_eps = model.cfg.eps
        # nn.RMSNorm(eps=None) uses the epsilon of its compute type, fp32 even for bf16 input.
        self.norm_eps = torch.finfo(torch.float32).eps
        self.weights = self._pack(model)

    @staticmethod
    def _pack(model: LanguageModel) -> list[torch.Tensor]:
        """[embed, head, final norm, then per layer: norm1, qkv (+ gate_down), conv [K, 3d],
        out, norm2, up, down, gate_up [r, d], gate_bias [d]]. Norm, conv and gate_up weights
        are fp32; GEMM weights keep the model dtype and are stored transposed, ``[in, out]``
        and contiguous (the GEMM runs faster on that layout). A gated model's gate_down
        [d, r] is appended to the qkv weight as r extra output columns."""
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().contiguous()

        def gemm(linear: torch.nn.Linear) -> torch.Tensor:
            return linear.weight.detach().t().contiguous()

        emb = model.embed.weight.detach()
        packed = [emb, emb.t().contiguous(), f32(model.norm.weight)]
        for block in model.layers:
            attn = block.attn
            conv = getattr(attn, "conv", None)
            down, up = getattr(attn, "gate_down", None), getattr(attn, "gate_up", None)
            qkv = gemm(attn.qkv)
            gate = [torch.empty(0), torch.empty(0)]
            if down is not None and up is not None:
                qkv = torch.cat([qkv, gemm(down)], dim=1).contiguous()
                gate = [f32(up.weight.t()), f32(up.bias)]
            packed += [
                f32(block.norm1.weight), qkv,
                f32(conv.T) if conv is not None else torch.empty(0),
                gemm(attn.out), f32(block.norm2.weight), gemm(block.mlp.up),
                gemm(block.mlp.down), *gate]
        return packed

    def __call__(self, tokens: torch.Tensor, state: LinearState,
                 with_head: bool = True) -> torch.Tensor:
        """tokens ``[B]`` -> logits ``[B, V]`` fp32; advances ``state`` (B rows) in place.
        ``with_head=False`` returns the last layer's output ``[B, d]`` instead (benchmarks
        time the layers and the LM head apart this way)."""
        return torch.ops.linserve.linear_step(
            tokens, self.weights, state.s, state.z, state.conv, self.heads, self.attn_eps,
            self.norm_eps, with_head)
