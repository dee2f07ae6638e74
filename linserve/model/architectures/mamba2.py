"""Pure Mamba2 (``Mamba2ForCausalLM``: Mamba-Codestral and the state-spaces Mamba2 models):
every block ``x + mixer(norm(x))`` with the Mamba2 mixer of
:mod:`linserve.model.layers.mamba2` (gate, then the grouped RMSNorm), no attention and no
MLP. The whole-model native step serves it (``decoder_step.cpp``), as it does Nemotron-H's
Mamba2 blocks."""

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
from linserve.model.architectures.mamba import MAX_POSITIONS, RENAMES
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba2 import Mamba2, Mamba2Shape
from linserve.model.layers.norms import RMSNorm


@dataclass(frozen=True, kw_only=True)
class Mamba2Config(DecoderConfig):
    num_hidden_layers: int
    mixer: Mamba2Shape
    eps: float

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Mamba2Config:
        require_activation(c)
        d, heads, head_dim = int(c["hidden_size"]), int(c["num_heads"]), int(c["head_dim"])
        if heads * head_dim != int(c.get("expand", 2)) * d:
            raise ValueError("num_heads × head_dim is not expand × hidden_size")
        groups = int(c.get("n_groups", 1))
        if heads % groups:
            raise ValueError(f"num_heads {heads} is not a multiple of n_groups {groups}")
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        limit = c.get("time_step_limit") or (0.0, float("inf"))
        mixer = Mamba2Shape(d, heads, head_dim, int(c.get("state_size", 128)), groups,
                            int(c.get("conv_kernel", 4)), eps,
                            bool(c.get("use_conv_bias", True)), bool(c.get("use_bias", False)),
                            (json_float(limit[0]), json_float(limit[1])))
        return cls(**DecoderConfig.shared(c, MAX_POSITIONS, False),
                   num_hidden_layers=int(c["num_hidden_layers"]), mixer=mixer, eps=eps)


def build(cfg: Mamba2Config) -> DecoderLM:
    d = cfg.hidden_size
    blocks = [Block(Mamba2(cfg.mixer), None, RMSNorm, d, cfg.eps)
              for _ in range(cfg.num_hidden_layers)]
    return DecoderLM(cfg, cfg.vocab_size, d, blocks, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


def describe(cfg: Mamba2Config) -> str:
    m = cfg.mixer
    return (f"mamba2 ({cfg.num_hidden_layers} layers, {m.heads} heads × {m.head_dim}, "
            f"d_state {m.d_state}, {m.groups} groups)")


FAMILY = HFFamily(Mamba2Config.from_hf, build, renamer(RENAMES),
                  describe)
