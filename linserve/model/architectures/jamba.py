"""Jamba (``JambaForCausalLM``): Mamba-1 layers (with weighted RMS norms on dt, B and C) and
GQA attention without positions every ``attn_layer_period`` layers from
``attn_layer_offset``; after each, experts every ``expert_layer_period`` layers from
``expert_layer_offset`` (a softmax router whose top k weights are left unnormalised) and a
SwiGLU elsewhere. Built from the shared Mamba-1 mixer, attention, experts and MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from linserve.model.architectures import bamba
from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer, require_activation
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba1 import Mamba1, Mamba1Shape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.moe import RouterSpec, SparseMoE
from linserve.model.layers.norms import RMSNorm


@dataclass(frozen=True, kw_only=True)
class JambaConfig(DecoderConfig):
    intermediate_size: int
    layer_types: tuple[str, ...]  # "attention" or "mamba"
    expert_layers: frozenset[int]
    attention: AttentionShape
    mamba: Mamba1Shape
    router: RouterSpec | None
    eps: float

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> JambaConfig:
        require_activation(c)
        d, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        eps = float(c.get("rms_norm_eps", 1e-6))
        period, offset = int(c.get("attn_layer_period", 8)), int(c.get("attn_layer_offset", 4))
        e_period, e_offset = (int(c.get("expert_layer_period", 2)),
                              int(c.get("expert_layer_offset", 1)))
        experts = int(c.get("num_experts", 16))
        rank = c.get("mamba_dt_rank", "auto")
        mamba = Mamba1Shape(d, int(c.get("mamba_expand", 2)) * d, int(c.get("mamba_d_state", 16)),
                            math.ceil(d / 16) if rank == "auto" else int(rank),
                            int(c.get("mamba_d_conv", 4)), bool(c.get("mamba_conv_bias", True)),
                            bool(c.get("mamba_proj_bias", False)), eps, bcdt_weights=True)
        return cls(
            **DecoderConfig.shared(c, 262_144, False),
            intermediate_size=int(c["intermediate_size"]),
            layer_types=tuple("attention" if i % period == offset else "mamba"
                              for i in range(n)),
            expert_layers=frozenset(i for i in range(n) if i % e_period == e_offset)
            if experts > 1 else frozenset(),
            attention=AttentionShape(d, heads, int(c.get("num_key_value_heads") or heads),
                                     d // heads, rotary_dim=0),
            mamba=mamba, eps=eps,
            router=RouterSpec(experts, int(c.get("num_experts_per_tok", 2)), scoring="softmax",
                              norm_topk=False) if experts > 1 else None)


def build(cfg: JambaConfig) -> DecoderLM:
    d = cfg.hidden_size

    def mlp(i: int) -> nn.Module:
        if i in cfg.expert_layers:
            assert cfg.router is not None
            return SparseMoE(d, cfg.intermediate_size, cfg.router)
        return SwiGLU(d, cfg.intermediate_size)

    layers = [Block(Attention(cfg.attention) if kind == "attention" else Mamba1(cfg.mamba),
                    mlp(i), RMSNorm, d, cfg.eps)
              for i, kind in enumerate(cfg.layer_types)]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


# Bamba's names (Jamba's layout), and the experts' router
RENAMES = [(r"^(model\.layers\.\d+)\.feed_forward\.router\.", r"\1.mlp.gate."),
           *bamba.RENAMES]


def describe(cfg: JambaConfig) -> str:
    attn = cfg.layer_types.count("attention")
    moe = ("" if cfg.router is None else f", experts in {len(cfg.expert_layers)} layers "
           f"({cfg.router.experts}, top {cfg.router.top_k})")
    return f"jamba (Mamba-1 {len(cfg.layer_types) - attn}, attention {attn} layers{moe})"


FAMILY = HFFamily(JambaConfig.from_hf, build, renamer(RENAMES), describe)
