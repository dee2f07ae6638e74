"""Nemotron-H (``nemotron_h``, ``NemotronHForCausalLM``): a stack of single-purpose blocks,
each ``x + mixer(norm(x))``, whose mixer is Mamba2 (:mod:`model.layers.mamba2`), grouped-query
attention without positions, or a squared-ReLU MLP, as ``layers_block_type`` (or the
published ``hybrid_override_pattern``: M, *, -) orders them. The Mamba2 time step is clamped
below at ``time_step_min``, as transformers' mixer does. Tensors are named ``backbone.*``
in the published checkpoints and ``model.*`` in transformers' own.

Mixture-of-experts blocks (``E`` / ``moe``) are refused at startup with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.architectures.family import HFFamily, renamer
from model.layers.attention import Attention, AttentionShape
from model.layers.decoder import Block, DecoderLM
from model.layers.mamba2 import Mamba2, Mamba2Shape
from model.layers.mlp import ReluSquaredMLP
from model.layers.norms import RMSNorm

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # linear_attention (Mamba2), full_attention, mlp
    attention: AttentionShape
    mamba: Mamba2Shape
    intermediate_size: int
    mlp_bias: bool
    eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

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
        if "moe" in types:
            raise NotImplementedError("nemotron_h with mixture-of-experts blocks (moe) is not "
                                      "served yet")
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or d // heads)
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        m_heads, m_dim = int(c["mamba_num_heads"]), int(c["mamba_head_dim"])
        return cls(
            vocab_size=int(c["vocab_size"]), hidden_size=d, layer_types=tuple(types),
            attention=AttentionShape(d, heads, int(c.get("num_key_value_heads") or heads),
                                     head_dim, rotary_dim=0,
                                     bias=bool(c.get("attention_bias", False)),
                                     out_bias=bool(c.get("attention_bias", False))),
            mamba=Mamba2Shape(
                d, m_heads, m_dim, int(c["ssm_state_size"]),
                int(c.get("n_groups", c.get("mamba_n_groups", 8))),
                int(c.get("conv_kernel", c.get("mamba_d_conv", 4))), eps,
                bool(c.get("use_conv_bias", c.get("mamba_conv_bias", True))),
                bool(c.get("use_bias", False)),
                (float(c.get("time_step_min", c.get("mamba_dt_min", 0.001))), float("inf"))),
            intermediate_size=int(c["intermediate_size"]),
            mlp_bias=bool(c.get("mlp_bias", False)), eps=eps,
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            tie_word_embeddings=False)  # never tied: transformers' class ties nothing


def build(cfg: NemotronHConfig) -> DecoderLM:
    d = cfg.hidden_size

    def block(kind: str) -> Block:
        if kind == "mlp":
            return Block(ReluSquaredMLP(d, cfg.intermediate_size, cfg.mlp_bias), None, RMSNorm,
                         d, cfg.eps)
        mixer = Mamba2(cfg.mamba) if kind == "linear_attention" else Attention(cfg.attention)
        return Block(mixer, None, RMSNorm, d, cfg.eps)

    return DecoderLM(cfg, cfg.vocab_size, d, [block(k) for k in cfg.layer_types],
                     RMSNorm(d, cfg.eps), cfg.tie_word_embeddings)


RENAMES = [
    (r"^(?:backbone|model)\.embeddings\.", "model.embed_tokens."),
    (r"^(?:backbone|model)\.norm_f\.", "model.norm."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.norm\.", r"model.\1.input_layernorm."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.mixer\.", r"model.\1.mixer."),
]


rename = renamer(RENAMES)


def describe(cfg: NemotronHConfig) -> str:
    counts = {k: cfg.layer_types.count(k) for k in ("linear_attention", "full_attention", "mlp")}
    return (f"nemotron_h (Mamba2 {counts['linear_attention']}, attention "
            f"{counts['full_attention']}, MLP {counts['mlp']} blocks)")


FAMILY = HFFamily("nemotron_h", ("nemotron_h",), NemotronHConfig.from_hf, build, rename,
                  describe)
