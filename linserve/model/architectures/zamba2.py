"""Zamba2 (``Zamba2ForCausalLM``): Mamba2 layers, and "hybrid" layers that first run one of
``num_mem_blocks`` shared attention-and-MLP blocks, in turn, on the concatenation of the
hidden state and the input embeddings, with per-layer low-rank adapters
(:mod:`linserve.model.layers.shared_block`). The shared blocks' weights are held once."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily, require_activation
from linserve.model.layers.attention import AttentionShape
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.hf_keys import rope_theta
from linserve.model.layers.mamba2 import Mamba2Shape
from linserve.model.layers.mlp import ACTIVATIONS
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.shared_block import Adapters, MambaLayer, SharedBlock, SharedBlockLM

HYBRID = "hybrid"


@dataclass(frozen=True, kw_only=True)
class Zamba2Config(DecoderConfig):
    intermediate_size: int
    layer_types: tuple[str, ...]  # "mamba" or "hybrid"
    mem_blocks: int
    adapter_rank: int
    attention_adapters: bool
    attention: AttentionShape
    mamba: Mamba2Shape
    eps: float
    act: str

    @property
    def hybrid_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == HYBRID]

    @property
    def blocks(self) -> int:
        """How many distinct shared blocks the hybrid layers use in turn: ``num_mem_blocks``
        (transformers ties the copies only with ``tie_word_embeddings``; untied, every
        hybrid layer has a block of its own)."""
        hybrid = len(self.hybrid_layers)
        return min(self.mem_blocks, hybrid) if self.tie_word_embeddings else hybrid

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Zamba2Config:
        act = str(c.get("hidden_act", "gelu"))
        if act not in ACTIVATIONS:
            require_activation(c, "gelu")
        if c.get("add_bias_linear"):
            raise ValueError("add_bias_linear is not served")
        d, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        adapters = bool(c.get("use_shared_attention_adapter", False))
        if adapters and kv_heads != heads:
            raise ValueError("attention adapters need num_key_value_heads = num_attention_heads")
        head_dim = 2 * d // heads
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not served")
        m_heads, inner = int(c.get("n_mamba_heads", 8)), int(c.get("mamba_expand", 2)) * d
        groups = int(c.get("mamba_ngroups", 1))
        if inner % m_heads or m_heads % groups:
            raise ValueError("n_mamba_heads divides neither the inner width nor into groups")
        attn = AttentionShape(2 * d, heads, kv_heads, head_dim,
                              rotary_dim=head_dim if c.get("use_mem_rope") else 0,
                              rope_theta=rope_theta(c, 10_000.0),
                              scale=(head_dim / 2) ** -0.5, out_dim=d)
        mamba = Mamba2Shape(d, m_heads, inner // m_heads, int(c.get("mamba_d_state", 64)),
                            groups, int(c.get("mamba_d_conv", 4)), 1e-5, conv_bias=True,
                            dt_limit=(float(c.get("time_step_min", 0.001)), float("inf")))
        types = c.get("layers_block_type") or c.get("layer_types")
        if not types or len(types) != int(c["num_hidden_layers"]):
            raise ValueError("layers_block_type does not give every layer's kind")
        return cls(**DecoderConfig.shared(c, 4096, True),
                   intermediate_size=int(c.get("intermediate_size") or 4 * d),
                   layer_types=tuple(HYBRID if t == HYBRID else "mamba" for t in types),
                   mem_blocks=int(c.get("num_mem_blocks", 1)),
                   adapter_rank=int(c.get("adapter_rank", 128)),
                   attention_adapters=adapters, attention=attn, mamba=mamba,
                   eps=float(c.get("rms_norm_eps", 1e-5)), act=act)


def build(cfg: Zamba2Config) -> DecoderLM:
    d, ff = cfg.hidden_size, cfg.intermediate_size
    hybrid = cfg.hybrid_layers
    shared = [SharedBlock(cfg.attention, d, ff, cfg.eps, cfg.act) for _ in range(cfg.blocks)]
    rank = cfg.adapter_rank
    layers = [MambaLayer(cfg.mamba, cfg.eps) if kind != HYBRID else
              MambaLayer(cfg.mamba, cfg.eps, hybrid.index(i) % cfg.blocks,
                         Adapters(cfg.attention, d, ff, rank,
                                  rank if cfg.attention_adapters else 0))
              for i, kind in enumerate(cfg.layer_types)]
    return SharedBlockLM(cfg, cfg.vocab_size, d, layers, shared, RMSNorm(d, cfg.eps),
                         cfg.tie_word_embeddings)


_ADAPTER = re.compile(r"^model\.layers\.\d+\.shared_transformer\.(?:self_attn\.linear_(q|k|v)"
                      r"_adapter_list|feed_forward\.(gate_up)_proj_adapter_list)\.(\d+)\.(.*)$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.*)$")
_MAMBA = re.compile(r"^model\.layers\.(\d+)\.(?:mamba_decoder\.)?(mamba\.|input_layernorm\.)")


def renames(cfg: Zamba2Config) -> Callable[[str], str | None]:
    """Checkpoint names to ours: the copy of the shared block stored under the c-th hybrid
    layer to ``model.shared_blocks.{c}`` (copies past :attr:`Zamba2Config.blocks` are tied
    to earlier ones: unused), the adapters a copy lists per hybrid layer i to that layer's
    ``adapters`` where the layer uses this copy, ``mamba_decoder`` and ``mamba`` to the
    layer and its ``mixer``."""
    hybrid = cfg.hybrid_layers

    def rename(name: str) -> str | None:
        shared = _SHARED.match(name)
        copy = hybrid.index(int(shared.group(1))) if shared else 0
        if shared and copy >= cfg.blocks:
            return None
        if hit := _ADAPTER.match(name):
            which, rest, i = hit.group(1) or hit.group(2), hit.group(4), int(hit.group(3))
            return (f"model.layers.{hybrid[i]}.adapters.{which}.{rest}"
                    if i % cfg.blocks == copy else None)
        if shared:
            return f"model.shared_blocks.{copy}.{shared.group(2)}"
        if hit := _MAMBA.match(name):
            part = "mixer." if hit.group(2) == "mamba." else hit.group(2)
            return f"model.layers.{hit.group(1)}.{part}{name[hit.end():]}"
        return "model.norm." + name[len("model.final_layernorm."):] \
            if name.startswith("model.final_layernorm.") else name

    return rename


def describe(cfg: Zamba2Config) -> str:
    hybrid = len(cfg.hybrid_layers)
    return (f"zamba2 (Mamba2 {len(cfg.layer_types)} layers, {hybrid} with one of "
            f"{cfg.mem_blocks} shared attention blocks)")


FAMILY = HFFamily(Zamba2Config.from_hf, build, lambda n: n, describe,
                  rename_for=renames)
