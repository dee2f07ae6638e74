"""RecurrentGemma (``RecurrentGemmaForCausalLM``, Griffin): residual blocks whose temporal
part is, by ``block_types`` in turn, Griffin's recurrent block with the RG-LRU
(:mod:`linserve.model.layers.rg_lru`) or local attention over the last
``attention_window_size`` tokens (a ring of keys, rotary on half of each head); each with a
GeGLU MLP (biases, ``intermediate_size / 2`` wide). Gemma's RMSNorm (scale 1 + w), the
embeddings scaled by √hidden (rounded to bf16, as transformers does) and the logits soft
cap. Every part of a session's state is constant in size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from linserve.model.architectures.family import DecoderConfig, HFFamily, json_float, renamer
from linserve.model.architectures.mamba import MAX_POSITIONS
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.hf_keys import rope_theta
from linserve.model.layers.mlp import ACTIVATIONS, SwiGLU
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.rg_lru import RecurrentBlock, RecurrentShape


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    """Gemma's RMSNorm: the weight is stored as w − 1."""
    return RMSNorm(dim, eps, offset=1.0)


@dataclass(frozen=True, kw_only=True)
class RecurrentGemmaConfig(DecoderConfig):
    intermediate_size: int
    layer_types: tuple[str, ...]  # "recurrent" or "attention"
    attention: AttentionShape
    recurrent: RecurrentShape
    eps: float
    soft_cap: float | None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> RecurrentGemmaConfig:
        act = str(c.get("hidden_activation", "gelu_pytorch_tanh"))
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not served")
        d, heads, n = int(c["hidden_size"]), int(c["num_attention_heads"]), int(
            c["num_hidden_layers"])
        width = int(c.get("lru_width") or d)
        if d % heads or width % heads:
            raise ValueError("hidden_size and lru_width are not multiples of "
                             "num_attention_heads")
        head_dim = d // heads
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not served")
        kinds = list(c.get("block_types") or ["recurrent", "recurrent", "attention"])
        if set(kinds) - {"recurrent", "attention"}:
            raise ValueError(f"block_types {kinds} are not recurrent or attention")
        attn = AttentionShape(
            d, heads, int(c.get("num_key_value_heads") or heads), head_dim,
            rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", 0.5))),
            rope_theta=rope_theta(c, 10_000.0),
            bias=bool(c.get("attention_bias", False)), out_bias=True,
            window=int(c.get("attention_window_size", 2048)))
        cap = c.get("logits_soft_cap")
        return cls(**DecoderConfig.shared({**c, "max_position_embeddings": MAX_POSITIONS},
                                          MAX_POSITIONS, True),
                   intermediate_size=int(c["intermediate_size"]),
                   layer_types=tuple((kinds * n)[:n]), attention=attn,
                   recurrent=RecurrentShape(d, width, heads, int(c.get("conv1d_width", 4)), act),
                   eps=float(c.get("rms_norm_eps", 1e-6)),
                   soft_cap=None if cap is None else json_float(cap))


def build(cfg: RecurrentGemmaConfig) -> DecoderLM:
    d, act = cfg.hidden_size, cfg.recurrent.act
    layers = [Block(Attention(cfg.attention) if kind == "attention"
                    else RecurrentBlock(cfg.recurrent),
                    SwiGLU(d, cfg.intermediate_size // 2, bias=True, act=act),
                    gemma_norm, d, cfg.eps)
              for kind in cfg.layer_types]
    # transformers keeps √hidden as a bf16 number, whatever the model's dtype
    scale = float(torch.tensor(d ** 0.5, dtype=torch.bfloat16, device="cpu"))
    return DecoderLM(cfg, cfg.vocab_size, d, layers, gemma_norm(d, cfg.eps),
                     cfg.tie_word_embeddings, embedding_scale=scale,
                     logits_soft_cap=cfg.soft_cap)


RENAMES = [
    (r"^(model\.layers\.\d+)\.temporal_pre_norm\.", r"\1.input_layernorm."),
    (r"^(model\.layers\.\d+)\.temporal_block\.", r"\1.mixer."),
    (r"^(model\.layers\.\d+)\.channel_pre_norm\.", r"\1.post_attention_layernorm."),
    (r"^(model\.layers\.\d+)\.mlp_block\.", r"\1.mlp."),
    (r"^model\.final_norm\.", "model.norm."),
]


def describe(cfg: RecurrentGemmaConfig) -> str:
    attn = cfg.layer_types.count("attention")
    return (f"recurrent_gemma (RG-LRU {len(cfg.layer_types) - attn}, local attention {attn} "
            f"layers, window {cfg.attention.window})")


FAMILY = HFFamily(RecurrentGemmaConfig.from_hf, build,
                  renamer(RENAMES), describe)
