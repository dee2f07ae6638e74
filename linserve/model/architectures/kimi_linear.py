"""Kimi-Linear (``kimi_linear``, ``KimiLinearForCausalLM``, Kimi-Linear-48B-A3B): Kimi Delta
Attention layers (:mod:`linserve.model.layers.kimi_delta`) and multi-head latent attention
without positions (:mod:`linserve.model.layers.mla`, a latent cache), per ``layer_types``
(or the published ``linear_attn_config``'s 1-based ``full_attn_layers`` / ``kda_layers``);
a SwiGLU on the first ``first_k_dense_replace`` layers (``mlp_layer_types``), then experts:
sigmoid scores chosen with ``e_score_correction_bias`` within the best ``topk_group`` of
``num_expert_group`` groups, normalised, times ``routed_scaling_factor``, plus a shared
expert. State: per KDA layer an S and a conv window (constant), per MLA layer a latent
cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from linserve.model.architectures import minimax
from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer, require_activation
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.kimi_delta import KdaShape, KimiDeltaAttention
from linserve.model.layers.mla import LatentAttention, MlaShape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.moe import RouterSpec, SparseMoE
from linserve.model.layers.norms import RMSNorm

LINEAR, FULL = "linear_attention", "full_attention"


def _layer_types(c: dict[str, Any], n: int) -> list[str]:
    """``layer_types``, or the published ``linear_attn_config``'s 1-based lists."""
    if c.get("layer_types"):
        return list(c["layer_types"])
    linear = c.get("linear_attn_config") or {}
    if "full_attn_layers" in linear and "kda_layers" in linear:
        types = [""] * n
        for i in linear["full_attn_layers"]:
            types[int(i) - 1] = FULL
        for i in linear["kda_layers"]:
            types[int(i) - 1] = LINEAR
        return types
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]


@dataclass(frozen=True, kw_only=True)
class KimiLinearConfig(DecoderConfig):
    intermediate_size: int
    moe_intermediate_size: int
    shared_size: int
    layer_types: tuple[str, ...]
    sparse_layers: frozenset[int]
    kda: KdaShape
    mla: MlaShape
    router: RouterSpec
    eps: float

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> KimiLinearConfig:
        require_activation(c)
        d, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
        types = _layer_types(c, n)
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types {types!r} is not {n} of {LINEAR} / {FULL}")
        mlp = c.get("mlp_layer_types") or [
            "dense" if i < int(c.get("first_k_dense_replace", 1)) else "sparse"
            for i in range(n)]
        linear = c.get("linear_attn_config") or {}
        eps = float(c.get("rms_norm_eps", 1e-5))
        kda = KdaShape(d, int(linear.get("num_heads", c.get("linear_num_heads", 32))),
                       int(linear.get("head_dim", c.get("linear_head_dim", 128))),
                       int(linear.get("short_conv_kernel_size",
                                      c.get("linear_conv_kernel_dim", 4))), eps)
        mla = MlaShape(d, int(c["num_attention_heads"]), int(c.get("q_lora_rank") or 0),
                       int(c.get("kv_lora_rank", 512)), int(c.get("qk_nope_head_dim", 128)),
                       int(c.get("qk_rope_head_dim", 64)), int(c.get("v_head_dim") or 128),
                       bool(c.get("attention_bias", False)))
        experts = int(c.get("num_experts", c.get("num_local_experts", 256)))
        router = RouterSpec(experts, int(c.get("num_experts_per_token",
                                               c.get("num_experts_per_tok", 8))),
                            scoring="sigmoid", norm_topk=bool(c.get("norm_topk_prob", True)),
                            norm_eps=1e-20, scaling=float(c.get("routed_scaling_factor", 1.0)),
                            expert_bias=True,
                            groups=int(c.get("num_expert_group", c.get("n_group", 1)) or 1),
                            topk_groups=int(c.get("topk_group", 1) or 1))
        moe = int(c.get("moe_intermediate_size", 1024))
        return cls(**DecoderConfig.shared(c, 1_048_576, False),
                   intermediate_size=int(c["intermediate_size"]), moe_intermediate_size=moe,
                   shared_size=moe * int(c.get("num_shared_experts",
                                               c.get("n_shared_experts", 1)) or 0),
                   layer_types=tuple(types),
                   sparse_layers=frozenset(i for i, k in enumerate(mlp) if k == "sparse"),
                   kda=kda, mla=mla, router=router, eps=eps,
                   ).tied(False)  # transformers never ties its head, whatever the config says


def build(cfg: KimiLinearConfig) -> DecoderLM:
    d = cfg.hidden_size

    def mlp(i: int) -> nn.Module:
        if i in cfg.sparse_layers:
            return SparseMoE(d, cfg.moe_intermediate_size, cfg.router, shared=cfg.shared_size)
        return SwiGLU(d, cfg.intermediate_size)

    layers = [Block(KimiDeltaAttention(cfg.kda) if kind == LINEAR else LatentAttention(cfg.mla),
                    mlp(i), RMSNorm, d, cfg.eps)
              for i, kind in enumerate(cfg.layer_types)]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


RENAMES = [
    # the forget gate's tensors, where transformers nests them
    (r"^(model\.layers\.\d+)\.self_attn\.forget_gate\.", r"\1.mixer."),
    (r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.gate\.e_score_correction_bias$",
     r"\1.mlp.gate.expert_bias"),
    (r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.shared_experts\.",
     r"\1.mlp.shared_expert."),
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.", r"\1.mlp.gate."),
    *minimax.RENAMES[1:4],
    (r"^(model\.layers\.\d+)\.block_sparse_moe\.", r"\1.mlp."),  # the dense layers too
    (r"^(model\.layers\.\d+)\.self_attn\.", r"\1.mixer."),
]


def describe(cfg: KimiLinearConfig) -> str:
    full = cfg.layer_types.count(FULL)
    return (f"kimi_linear (KDA {len(cfg.layer_types) - full}, MLA {full} layers; "
            f"{cfg.router.experts} experts, top {cfg.router.top_k})")


FAMILY = HFFamily(KimiLinearConfig.from_hf, build,
                  renamer(RENAMES), describe)
