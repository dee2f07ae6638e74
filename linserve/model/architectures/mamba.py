"""Mamba and Falcon-Mamba (``MambaForCausalLM``, ``FalconMambaForCausalLM``): pure Mamba-1
stacks, every block ``x + mixer(norm(x))`` with the selective-scan mixer of
:mod:`linserve.model.layers.mamba1`; no attention and no MLP, so a session's state is
constant whatever its length. Falcon-Mamba adds weightless RMS norms on the mixer's B, C and
time step (``mixer_rms_eps``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer, require_activation
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba1 import Mamba1, Mamba1Shape
from linserve.model.layers.norms import RMSNorm

# No position limit of its own: the context a KV cache would bound (none here).
MAX_POSITIONS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class MambaConfig(DecoderConfig):
    num_hidden_layers: int
    mixer: Mamba1Shape
    eps: float
    falcon: bool

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> MambaConfig:
        require_activation(c)
        d = int(c["hidden_size"])
        inner = int(c.get("intermediate_size") or int(c.get("expand", 2)) * d)
        rank = c.get("time_step_rank", "auto")
        falcon = c.get("model_type") == "falcon_mamba"
        mixer = Mamba1Shape(
            d, inner, int(c.get("state_size", 16)),
            math.ceil(d / 16) if rank == "auto" else int(rank), int(c.get("conv_kernel", 4)),
            bool(c.get("use_conv_bias", True)), bool(c.get("use_bias", False)),
            float(c.get("mixer_rms_eps", 1e-6)) if falcon else None)
        return cls(**DecoderConfig.shared(c, MAX_POSITIONS, True),
                   num_hidden_layers=int(c["num_hidden_layers"]), mixer=mixer,
                   eps=float(c.get("layer_norm_epsilon", 1e-5)), falcon=falcon)


def build(cfg: MambaConfig) -> DecoderLM:
    d = cfg.hidden_size
    blocks = [Block(Mamba1(cfg.mixer), None, RMSNorm, d, cfg.eps)
              for _ in range(cfg.num_hidden_layers)]
    return DecoderLM(cfg, cfg.vocab_size, d, blocks, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


RENAMES = [
    (r"^(?:backbone|model)\.embeddings\.", "model.embed_tokens."),
    (r"^(?:backbone|model)\.norm_f\.", "model.norm."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.norm\.", r"model.\1.input_layernorm."),
    (r"^(?:backbone|model)\.(layers\.\d+)\.mixer\.", r"model.\1.mixer."),
]


def describe(cfg: MambaConfig) -> str:
    m = cfg.mixer
    return (f"{'falcon_mamba' if cfg.falcon else 'mamba'} (Mamba-1, {cfg.num_hidden_layers} "
            f"layers, inner {m.inner}, d_state {m.d_state}, dt rank {m.dt_rank})")


FAMILY = HFFamily(MambaConfig.from_hf, build,
                  renamer(RENAMES), describe)
