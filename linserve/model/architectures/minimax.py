"""MiniMax-Text-01 (``minimax``, ``MiniMaxForCausalLM``): lightning attention
(:mod:`linserve.model.layers.lightning`) interleaved with softmax GQA attention with RoPE, per
``layer_types``; experts in every layer (Mixtral's: a softmax router, the top k renormalised).

Its residual is not the usual one: the normed input is what carries on,
``h = norm(x); y = α·h + β·attention(h)``, then ``z = norm(y); out = α'·z + β'·experts(z)``,
with the ``*_alpha_factor`` / ``*_beta_factor`` of each layer kind. State: per lightning
layer an S ``[H, D, D]`` (constant), per attention layer a KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from linserve.model.architectures import jamba
from linserve.model.architectures.family import (
    DecoderConfig,
    HFFamily,
    layer_types,
    renamer,
    require_activation,
)
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import LayerPart
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.lightning import LightningAttention
from linserve.model.layers.moe import RouterSpec, SparseMoE
from linserve.model.layers.norms import RMSNorm

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class MiniMaxConfig(DecoderConfig):
    intermediate_size: int
    layer_types: tuple[str, ...]
    attention: AttentionShape
    router: RouterSpec
    eps: float
    factors: dict[str, tuple[float, float]]  # LINEAR, FULL, "mlp" -> (alpha, beta)

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> MiniMaxConfig:
        require_activation(c)
        d = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        types = layer_types(c, (LINEAR, FULL))
        head_dim = int(c.get("head_dim") or d // heads)
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not served")
        if c.get("sliding_window"):
            raise ValueError("sliding_window is not served for MiniMax")
        attn = AttentionShape.from_hf(c, theta=1_000_000.0, rotary_dim=head_dim, bias=False,
                                      out_bias=False)
        factors = {kind: (float(c.get(f"{name}_alpha_factor", 1)),
                          float(c.get(f"{name}_beta_factor", 1)))
                   for kind, name in ((LINEAR, "linear_attn"), (FULL, "full_attn"),
                                      ("mlp", "mlp"))}
        return cls(**DecoderConfig.shared(c, 131_072, False),
                   intermediate_size=int(c["intermediate_size"]), layer_types=types,
                   attention=attn, eps=float(c.get("rms_norm_eps", 1e-5)), factors=factors,
                   router=RouterSpec(int(c.get("num_local_experts", 8)),
                                     int(c.get("num_experts_per_tok", 2)), scoring="softmax"))


class MiniMaxLayer(nn.Module):
    """One layer (see the module docstring): ``input_layernorm``, ``mixer``,
    ``post_attention_layernorm``, ``mlp``."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, dim: int, eps: float,
                 factors: tuple[float, float], mlp_factors: tuple[float, float]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.mixer: Any = mixer
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = mlp
        self.factors, self.mlp_factors = factors, mlp_factors

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        return self.mixer.new_entries(batch, max_context)

    def native_parts(self) -> tuple[LayerPart, LayerPart]:
        """The two parts as the native step composes them: each from its normed input."""
        return (LayerPart(self.mixer, self.input_layernorm, None, True, *self.factors),
                LayerPart(self.mlp, self.post_attention_layernorm, None, True,
                          *self.mlp_factors))

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, d]`` (``[B, d]`` for ``one_token``) -> the same shape."""
        h = self.input_layernorm(x)
        a = self.mixer.step(h, entries, lengths) if one_token else \
            self.mixer(h, entries, lengths, new)
        alpha, beta = self.factors
        z = self.post_attention_layernorm(h * alpha + a * beta)
        alpha, beta = self.mlp_factors
        return z * alpha + self.mlp(z) * beta


def build(cfg: MiniMaxConfig) -> DecoderLM:
    d, s = cfg.hidden_size, cfg.attention
    n = len(cfg.layer_types)
    layers = [MiniMaxLayer(LightningAttention(d, s.heads, s.head_dim, i, n) if kind == LINEAR
                           else Attention(s),
                           SparseMoE(d, cfg.intermediate_size, cfg.router), d, cfg.eps,
                           cfg.factors[kind], cfg.factors["mlp"])
              for i, kind in enumerate(cfg.layer_types)]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


# Mixtral's published names (block_sparse_moe, experts w1 / w3 / w2) and transformers' own
RENAMES = [
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.", r"\1.mlp.gate."),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.",
     r"\1.mlp.experts.\2.gate_proj."),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.",
     r"\1.mlp.experts.\2.up_proj."),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.",
     r"\1.mlp.experts.\2.down_proj."),
    (r"^(model\.layers\.\d+)\.self_attn\.", r"\1.mixer."),
    *jamba.RENAMES[:1],
]


def describe(cfg: MiniMaxConfig) -> str:
    full = cfg.layer_types.count(FULL)
    return (f"minimax (lightning attention {len(cfg.layer_types) - full}, softmax attention "
            f"{full} layers; {cfg.router.experts} experts, top {cfg.router.top_k})")


FAMILY = HFFamily(MiniMaxConfig.from_hf, build, renamer(RENAMES),
                  describe)
