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
        n = int(c["num_hidden_layers"])
        eps = float(c.get("rms_norm_eps", 1e-5))
        attn = AttentionShape.from_hf(c)
        mamba = Mamba2Shape.from_hf(c, eps)
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
