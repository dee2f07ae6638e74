"""Bamba (``BambaForCausalLM``): Mamba2 layers with GQA attention at ``attn_layer_indices``
(rotary on the first ``partial_rotary_factor`` of each head), and a SwiGLU MLP in every
layer. The shared Mamba2 mixer, attention and MLP of :mod:`linserve.model.layers`; served by
the whole-model native step as Granite-4.0-H is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import (
    DecoderConfig,
    HFFamily,
    json_float,
    renamer,
    require_activation,
)
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba2 import Mamba2, Mamba2Shape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm


@dataclass(frozen=True, kw_only=True)
class BambaConfig(DecoderConfig):
    intermediate_size: int
    attention_layers: frozenset[int]
    num_hidden_layers: int
    attention: AttentionShape
    mamba: Mamba2Shape
    eps: float
    mlp_bias: bool

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> BambaConfig:
        require_activation(c)
        d, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or d // heads)
        rope = c.get("rope_parameters") or {}
        eps = float(c.get("rms_norm_eps", 1e-5))
        m_heads, inner = int(c["mamba_n_heads"]), int(c.get("mamba_expand", 2)) * d
        m_head_dim = c.get("mamba_d_head", "auto")
        m_head_dim = inner // m_heads if m_head_dim in (None, "auto") else int(m_head_dim)
        if m_heads * m_head_dim != inner:
            raise ValueError("mamba_n_heads × mamba_d_head is not mamba_expand × hidden_size")
        limit = c.get("time_step_limit") or (0.0, float("inf"))
        attn = AttentionShape(
            d, heads, int(c.get("num_key_value_heads") or heads), head_dim,
            rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", 1.0))),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10_000.0))),
            bias=bool(c.get("attention_bias", False)),
            out_bias=bool(c.get("attention_bias", False)))
        mamba = Mamba2Shape(d, m_heads, m_head_dim, int(c["mamba_d_state"]),
                            int(c.get("mamba_n_groups", 1)), int(c.get("mamba_d_conv", 4)), eps,
                            bool(c.get("mamba_conv_bias", True)),
                            bool(c.get("mamba_proj_bias", False)),
                            (json_float(limit[0]), json_float(limit[1])))
        return cls(**DecoderConfig.shared(c, 262_144, False),
                   intermediate_size=int(c["intermediate_size"]),
                   attention_layers=frozenset(int(i) for i in c.get("attn_layer_indices") or []),
                   num_hidden_layers=n, attention=attn, mamba=mamba, eps=eps,
                   mlp_bias=bool(c.get("mlp_bias", False)))


def build(cfg: BambaConfig) -> DecoderLM:
    d = cfg.hidden_size
    layers = [Block(Attention(cfg.attention) if i in cfg.attention_layers
                    else Mamba2(cfg.mamba),
                    SwiGLU(d, cfg.intermediate_size, cfg.mlp_bias), RMSNorm, d, cfg.eps)
              for i in range(cfg.num_hidden_layers)]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


RENAMES = [
    (r"^(model\.layers\.\d+)\.(?:mamba|self_attn)\.", r"\1.mixer."),
    (r"^(model\.layers\.\d+)\.feed_forward\.", r"\1.mlp."),
    (r"^(model\.layers\.\d+)\.pre_ff_layernorm\.", r"\1.post_attention_layernorm."),
    (r"^model\.final_layernorm\.", "model.norm."),
]


def describe(cfg: BambaConfig) -> str:
    attn = len(cfg.attention_layers)
    return (f"bamba (Mamba2 {cfg.num_hidden_layers - attn}, attention {attn} layers, "
            f"SwiGLU in each)")


FAMILY = HFFamily(BambaConfig.from_hf, build, renamer(RENAMES), describe)
