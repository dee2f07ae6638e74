"""Granite-4.0-H (``granitemoehybrid``): Mamba2 layers (:mod:`linserve.model.layers.mamba2`) and
grouped-query attention layers as ``layer_types`` orders them, each followed by the shared
SwiGLU MLP, plus, with ``num_local_experts > 0`` (H-Tiny, H-Small), a sparse mixture of
SwiGLU experts (:mod:`linserve.model.layers.moe`: the top ``num_experts_per_tok`` router logits,
softmaxed over those) whose output is added to the shared MLP's; Granite's
multipliers (``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` as the
score scale, ``logits_scaling``); RoPE or none, per ``position_embedding_type``. State: the
Mamba2 layers' SSM state and conv window (constant) and a KV cache per attention layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba2 import Mamba2, Mamba2Shape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.moe import RouterSpec, SparseMoE
from linserve.model.layers.norms import RMSNorm

MAMBA, ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class GraniteHybridConfig(DecoderConfig):
    shared_intermediate_size: int
    layer_types: tuple[str, ...]  # "mamba" or "attention"
    attention: AttentionShape
    mamba: Mamba2Shape
    rms_norm_eps: float
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    router: RouterSpec | None  # None: dense
    expert_size: int

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> GraniteHybridConfig:
        experts = int(c.get("num_local_experts", 0) or 0)
        d, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
        types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * n
        if len(types) != n or set(types) - {*MAMBA, *ATTENTION}:
            raise ValueError(f"layer_types {types!r} is not {n} of mamba / attention")
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or d // heads)
        eps = float(c.get("rms_norm_eps", 1e-6))
        return cls(
            **DecoderConfig.shared(c, 131_072, False),
            shared_intermediate_size=int(c["shared_intermediate_size"]),
            layer_types=tuple("mamba" if t in MAMBA else "attention" for t in types),
            attention=AttentionShape.from_hf(
                c, rotary_dim=head_dim if c.get("position_embedding_type") == "rope" else 0,
                scale=float(c.get("attention_multiplier", head_dim ** -0.5))),
            mamba=Mamba2Shape.from_hf(c, eps),
            rms_norm_eps=eps,
            embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(c.get("residual_multiplier", 1.0)),
            logits_scaling=float(c.get("logits_scaling", 1.0)),
            router=RouterSpec(experts, int(c["num_experts_per_tok"]), scoring="softmax_topk")
            if experts else None,
            expert_size=int(c.get("intermediate_size") or 0))


def build(cfg: GraniteHybridConfig) -> DecoderLM:
    d = cfg.hidden_size
    shared = cfg.shared_intermediate_size

    def mlp() -> nn.Module:
        if cfg.router is None:
            return SwiGLU(d, shared, fused=True)
        return SparseMoE(d, cfg.expert_size, cfg.router, shared=shared, shared_fused=True)

    layers = [Block(Mamba2(cfg.mamba) if kind == "mamba" else Attention(cfg.attention),
                    mlp(), RMSNorm, d, cfg.rms_norm_eps, cfg.residual_multiplier)
              for kind in cfg.layer_types]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.rms_norm_eps),
                     cfg.tie_word_embeddings, cfg.embedding_multiplier, cfg.logits_scaling)


RENAMES = [
    (r"^(model\.layers\.\d+)\.(?:mamba|self_attn)\.", r"\1.mixer."),
    (r"^(model\.layers\.\d+)\.shared_mlp\.input_linear\.", r"\1.mlp.gate_up_proj."),
    (r"^(model\.layers\.\d+)\.shared_mlp\.output_linear\.", r"\1.mlp.down_proj."),
]
# with experts: the shared MLP sits beside them, and the experts are stacked
MOE_RENAMES = [
    (r"^(model\.layers\.\d+)\.(?:mamba|self_attn)\.", r"\1.mixer."),
    (r"^(model\.layers\.\d+)\.shared_mlp\.input_linear\.",
     r"\1.mlp.shared_expert.gate_up_proj."),
    (r"^(model\.layers\.\d+)\.shared_mlp\.output_linear\.",
     r"\1.mlp.shared_expert.down_proj."),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.input_linear\.weight$",
     r"\1.mlp.experts.gate_up_proj"),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.output_linear\.weight$",
     r"\1.mlp.experts.down_proj"),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.router\.layer\.", r"\1.mlp.gate."),
]


rename = renamer(RENAMES)
_moe_rename = renamer(MOE_RENAMES)


def rename_for(cfg: GraniteHybridConfig) -> Callable[[str], str | None]:
    return rename if cfg.router is None else _moe_rename


def describe(cfg: GraniteHybridConfig) -> str:
    attn = sum(t == "attention" for t in cfg.layer_types)
    r = cfg.router
    kind = "dense" if r is None else f"{r.experts} experts, top {r.top_k}"
    return (f"granitemoehybrid ({kind}: Mamba2 + GQA attention, {attn} of "
            f"{len(cfg.layer_types)} layers attention)")


FAMILY = HFFamily(GraniteHybridConfig.from_hf, build,
                  rename, describe, rename_for)
