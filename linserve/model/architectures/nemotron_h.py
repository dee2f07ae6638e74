"""Nemotron-H (``nemotron_h``, ``NemotronHForCausalLM``): a stack of single-purpose blocks,
each ``x + mixer(norm(x))``, whose mixer is Mamba2 (:mod:`linserve.model.layers.mamba2`),
grouped-query attention without positions, or a squared-ReLU MLP, as ``layers_block_type`` (or the
published ``hybrid_override_pattern``: M, *, -) orders them. The Mamba2 time step is clamped
below at ``time_step_min``, as transformers' mixer does. Tensors are named ``backbone.*``
in the published checkpoints and ``model.*`` in transformers' own.

Mixture-of-experts blocks (``E`` / ``moe``; Nemotron-3-Nano-30B-A3B) are
:class:`linserve.model.layers.moe.SparseMoE` in the mixer's place: squared-ReLU experts of
``moe_intermediate_size`` (optionally at ``moe_latent_size``), a sigmoid router choosing the
top ``num_experts_per_tok`` by score plus ``e_score_correction_bias`` within the best
``topk_group`` of ``n_group`` groups, the chosen weights normalised (``norm_topk_prob``) and
scaled by ``routed_scaling_factor``, and a squared-ReLU shared expert of
``moe_shared_expert_intermediate_size`` on every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba2 import Mamba2, Mamba2Shape
from linserve.model.layers.mlp import ReluSquaredMLP
from linserve.model.layers.moe import ExpertsSpec, RouterSpec, SparseMoE
from linserve.model.layers.norms import RMSNorm

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class MoeShape:
    """The ``moe`` blocks: routing, the experts' width and form, the shared expert's width."""

    router: RouterSpec
    hidden: int
    form: ExpertsSpec
    shared: int

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> MoeShape:
        experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or 0)
        router = RouterSpec(experts, int(c["num_experts_per_tok"]), scoring="sigmoid",
                            norm_topk=bool(c.get("norm_topk_prob", True)), norm_eps=1e-20,
                            scaling=float(c.get("routed_scaling_factor") or 1.0),
                            expert_bias=True, groups=int(c.get("n_group") or 1),
                            topk_groups=int(c.get("topk_group") or 1))
        form = ExpertsSpec("relu2", int(c.get("moe_latent_size") or 0),
                           bool(c.get("mlp_bias", False)))
        return cls(router, int(c["moe_intermediate_size"]), form,
                   int(c.get("moe_shared_expert_intermediate_size") or 0))


@dataclass(frozen=True, kw_only=True)
class NemotronHConfig(DecoderConfig):
    layer_types: tuple[str, ...]  # linear_attention (Mamba2), full_attention, mlp
    attention: AttentionShape
    mamba: Mamba2Shape
    intermediate_size: int
    mlp_bias: bool
    eps: float
    moe: MoeShape | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> NemotronHConfig:
        d = int(c["hidden_size"])
        types = c.get("layers_block_type") or c.get("layer_types")
        if types is None:
            pattern = c.get("hybrid_override_pattern")
            if not isinstance(pattern, str) or set(pattern) - set(PATTERN):
                raise ValueError("no layers_block_type, and no hybrid_override_pattern of "
                                 "M, *, - and E")
            types = [PATTERN[ch] for ch in pattern]
        if set(types) - {"linear_attention", "full_attention", "mlp", "moe"}:
            raise ValueError(f"unknown layers_block_type {sorted(set(types))}")
        if c.get("mlp_hidden_act", "relu2") != "relu2":
            raise NotImplementedError(f"nemotron_h with mlp_hidden_act "
                                      f"{c['mlp_hidden_act']!r} is not served (relu2 is)")
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        m_heads, m_dim = int(c["mamba_num_heads"]), int(c["mamba_head_dim"])
        return cls(
            **DecoderConfig.shared(c, 4096, False), layer_types=tuple(types),
            attention=AttentionShape.from_hf(c, rotary_dim=0),
            mamba=Mamba2Shape(
                d, m_heads, m_dim, int(c["ssm_state_size"]),
                int(c.get("n_groups", c.get("mamba_n_groups", 8))),
                int(c.get("conv_kernel", c.get("mamba_d_conv", 4))), eps,
                bool(c.get("use_conv_bias", c.get("mamba_conv_bias", True))),
                bool(c.get("use_bias", False)),
                (float(c.get("time_step_min", c.get("mamba_dt_min", 0.001))), float("inf"))),
            intermediate_size=int(c["intermediate_size"]),
            mlp_bias=bool(c.get("mlp_bias", False)), eps=eps,
            moe=MoeShape.from_hf(c) if "moe" in types else None,
        ).tied(False)  # never tied: transformers' class ties nothing


def build(cfg: NemotronHConfig) -> DecoderLM:
    d = cfg.hidden_size

    def block(kind: str) -> Block:
        if kind == "mlp":
            return Block(ReluSquaredMLP(d, cfg.intermediate_size, cfg.mlp_bias), None, RMSNorm,
                         d, cfg.eps)
        if kind == "moe":
            assert cfg.moe is not None
            m = cfg.moe
            return Block(SparseMoE(d, m.hidden, m.router, m.shared, form=m.form), None,
                         RMSNorm, d, cfg.eps)
        mixer = Mamba2(cfg.mamba) if kind == "linear_attention" else Attention(cfg.attention)
        return Block(mixer, None, RMSNorm, d, cfg.eps)

    return DecoderLM(cfg, cfg.vocab_size, d, [block(k) for k in cfg.layer_types],
                     RMSNorm(d, cfg.eps), cfg.tie_word_embeddings)


RENAMES = [
    (r"^(?:backbone|model)\.embeddings\.", "model.embed_tokens."),
    (r"^(?:backbone|model)\.norm_f\.", "model.norm."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.norm\.", r"model.\1.input_layernorm."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.mixer\.shared_experts\.",
     r"model.\1.mixer.shared_expert."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.mixer\.gate\.e_score_correction_bias$",
     r"model.\1.mixer.gate.expert_bias"),
    (r"^(?:backbone|model)\.(layers\.\d+)\.mixer\.", r"model.\1.mixer."),
]


rename = renamer(RENAMES)


def describe(cfg: NemotronHConfig) -> str:
    counts = {k: cfg.layer_types.count(k)
              for k in ("linear_attention", "full_attention", "mlp", "moe")}
    moe = "" if cfg.moe is None else (f", MoE {counts['moe']} blocks of "
                                      f"{cfg.moe.router.experts} experts, top "
                                      f"{cfg.moe.router.top_k}")
    return (f"nemotron_h (Mamba2 {counts['linear_attention']}, attention "
            f"{counts['full_attention']}, MLP {counts['mlp']} blocks{moe})")


FAMILY = HFFamily(NemotronHConfig.from_hf, build, rename,
                  describe)
