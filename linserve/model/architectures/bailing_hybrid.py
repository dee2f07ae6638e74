"""The Ling hybrids (``bailing_hybrid``, ``BailingHybridForCausalLM``, Ling 3.0): Kimi-Linear's
layer plan with Ling's parts. Kimi Delta Attention with a one-matrix forget gate (the safe
gate ``kda_lower_bound · sigmoid(e^A_log · f)`` with ``kda_safe_gate``) and output gate, in
groups of ``layer_group_size`` whose last layer is multi-head latent attention with
DeepSeek's interleaved rotary positions and a sigmoid gate per head; a SwiGLU on the first
``first_k_dense_replace`` layers, then experts (DeepSeek-V3's routing) with shared experts.
The checkpoint's multi-token-prediction layers (past ``num_hidden_layers``) are not read:
they serve speculative decoding, which this server does not do yet."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from linserve.model.architectures import kimi_linear
from linserve.model.architectures.family import DecoderConfig, HFFamily, require_activation
from linserve.model.architectures.kimi_linear import FULL, LINEAR, KimiLinearConfig
from linserve.model.layers.hf_keys import rope_theta
from linserve.model.layers.kimi_delta import KdaShape
from linserve.model.layers.mla import MlaShape
from linserve.model.layers.moe import RouterSpec


@dataclass(frozen=True, kw_only=True)
class BailingHybridConfig(KimiLinearConfig):
    """Kimi-Linear's fields (the layer plan, KDA and MLA shapes, routing), read from Ling's
    config."""

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> BailingHybridConfig:
        require_activation(c)
        d, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
        group = int(c.get("layer_group_size", 6))
        types = list(c.get("layer_types") or [FULL if (i + 1) % group == 0 else LINEAR
                                              for i in range(n)])
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types {types!r} is not {n} of {LINEAR} / {FULL}")
        dense = int(c.get("first_k_dense_replace", 1))
        mlp = c.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)]
        eps = float(c.get("rms_norm_eps", 1e-6))
        kda = KdaShape(d, int(c.get("linear_num_heads", 32)), int(c.get("linear_head_dim", 128)),
                       int(c.get("linear_conv_kernel_dim", c.get("short_conv_kernel_size", 4))),
                       eps, low_rank_gates=False,
                       safe_lower=float(c.get("kda_lower_bound", -5.0))
                       if c.get("kda_safe_gate", True) else None)
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not served")
        mla = MlaShape(d, int(c["num_attention_heads"]), 0, int(c.get("kv_lora_rank", 512)),
                       int(c.get("qk_nope_head_dim", 128)), int(c.get("qk_rope_head_dim", 64)),
                       int(c.get("v_head_dim") or 128), bool(c.get("attention_bias", False)),
                       rope_theta=rope_theta(c, 6e6),
                       head_gate=True)
        experts = int(c.get("num_experts") or c.get("n_routed_experts") or 256)
        router = RouterSpec(experts, int(c.get("num_experts_per_token",
                                               c.get("num_experts_per_tok", 8))),
                            scoring="sigmoid",
                            norm_topk=bool(c.get("moe_renormalize", c.get("norm_topk_prob",
                                                                          True))),
                            norm_eps=1e-20, scaling=float(c.get("routed_scaling_factor", 1.0)),
                            expert_bias=True,
                            groups=int(c.get("num_expert_group", c.get("n_group", 1)) or 1),
                            topk_groups=int(c.get("topk_group", 1) or 1))
        moe = int(c.get("moe_intermediate_size", 1024))
        return cls(**DecoderConfig.shared({**c, "max_position_embeddings":
                                           c.get("model_max_length", 262_144)}, 262_144, False),
                   intermediate_size=int(c["intermediate_size"]), moe_intermediate_size=moe,
                   shared_size=moe * int(c.get("num_shared_experts",
                                               c.get("n_shared_experts", 1)) or 0),
                   layer_types=tuple(types),
                   sparse_layers=frozenset(i for i, k in enumerate(mlp) if k == "sparse"),
                   kda=kda, mla=mla, router=router, eps=eps,
                   ).tied(False)  # transformers never ties its head


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PARTS = [  # the published names (and transformers' own) to ours, within a layer
    (re.compile(r"\.(?:attention|self_attn)\.(?:forget_gate\.)?"), ".mixer."),
    (re.compile(r"\.mixer\.dense\."), ".mixer.o_proj."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
]


def renames(cfg: BailingHybridConfig) -> Callable[[str], str | None]:
    """Checkpoint names to ours; the multi-token-prediction layers (past the config's
    layers) are left unread."""
    layers = len(cfg.layer_types)

    def rename(name: str) -> str | None:
        if name.startswith("model.word_embeddings."):
            return "model.embed_tokens." + name.removeprefix("model.word_embeddings.")
        hit = _LAYER.match(name)
        if hit is None:
            return name
        if int(hit.group(1)) >= layers:
            return None
        for pattern, repl in _PARTS:
            name = pattern.sub(repl, name)
        return name

    return rename


def describe(cfg: BailingHybridConfig) -> str:
    full = cfg.layer_types.count(FULL)
    return (f"bailing_hybrid (KDA {len(cfg.layer_types) - full}, MLA {full} layers; "
            f"{cfg.router.experts} experts, top {cfg.router.top_k})")


FAMILY = HFFamily(BailingHybridConfig.from_hf,
                  kimi_linear.build,
                  lambda n: n, describe, rename_for=renames)
