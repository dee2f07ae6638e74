"""LFM2 / LFM2.5 (``lfm2``, ``Lfm2ForCausalLM``): double-gated short convolutions
(:mod:`linserve.model.layers.short_conv`) interleaved with grouped-query attention with q/k RMSNorm
and rotary positions on the layers ``layer_types`` (or ``full_attn_idxs``) names; a SwiGLU
MLP sized by the ``block_*`` rule; RMSNorm; a tied head. State: a conv window per conv layer
(constant) and a KV cache per attention layer.

Reads both the published config (``block_ff_dim``, ``tie_embedding``, ``full_attn_idxs``,
``rope_theta``) and the one transformers saves (``intermediate_size``, ``layer_types``,
``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.hf_keys import rope_theta
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.short_conv import ShortConv


@dataclass(frozen=True, kw_only=True)
class Lfm2Config(DecoderConfig):
    ff_size: int  # the MLP's hidden size after the block_* rule
    layer_types: tuple[str, ...]  # "conv" or "full_attention"
    num_attention_heads: int
    num_key_value_heads: int
    norm_eps: float
    rope_theta: float
    conv_width: int
    conv_bias: bool

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Lfm2Config:
        n = int(c["num_hidden_layers"])
        types = c.get("layer_types")
        if types is None:
            full = c.get("full_attn_idxs")
            full = list(range(n)) if full is None else [int(i) for i in full]
            types = ["full_attention" if i in full else "conv" for i in range(n)]
        if len(types) != n or set(types) - {"conv", "full_attention"}:
            raise ValueError(f"layer_types {types!r} is not {n} of conv / full_attention")
        heads = int(c["num_attention_heads"])
        if int(c["hidden_size"]) % heads:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")
        return cls(
            **DecoderConfig.shared(c, 128_000, True), ff_size=ff_size(c),
            layer_types=tuple(types), num_attention_heads=heads,
            num_key_value_heads=int(c["num_key_value_heads"]),
            norm_eps=float(c.get("norm_eps", 1e-5)),
            rope_theta=rope_theta(c, 1_000_000.0),
            conv_width=int(c.get("conv_L_cache", 3)), conv_bias=bool(c.get("conv_bias", False)),
        ).tied(bool(c.get("tie_embedding", c.get("tie_word_embeddings", True))))


def ff_size(c: dict[str, Any]) -> int:
    """The MLP's hidden size: ``block_ff_dim`` (or ``intermediate_size``), with
    ``block_auto_adjust_ff_dim`` taken to 2/3, times ``block_ffn_dim_multiplier``, rounded
    up to ``block_multiple_of`` (transformers' ``Lfm2MLP``)."""
    size = int(c["block_ff_dim"] if "block_ff_dim" in c else c["intermediate_size"])
    if c.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult = c.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            size = int(float(mult) * size)
            step = int(c.get("block_multiple_of", 256))
            size = step * ((size + step - 1) // step)
    return size


def build(cfg: Lfm2Config) -> DecoderLM:
    return build_with(cfg, cfg, [SwiGLU(cfg.hidden_size, cfg.ff_size)
                                 for _ in cfg.layer_types])


def build_with(cfg: Lfm2Config, whole: Any, mlps: list[nn.Module]) -> DecoderLM:
    """LFM2's stack with the given feed-forward block per layer (LFM2-MoE's experts);
    ``whole`` is the config the module keeps."""
    d = cfg.hidden_size
    head_dim = d // cfg.num_attention_heads
    shape = AttentionShape(d, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                           rotary_dim=head_dim, rope_theta=cfg.rope_theta, qk_norm=True,
                           eps=cfg.norm_eps)
    layers = [Block(Attention(shape) if kind == "full_attention"
                    else ShortConv(d, cfg.conv_width, cfg.conv_bias),
                    mlp, RMSNorm, d, cfg.norm_eps)
              for kind, mlp in zip(cfg.layer_types, mlps, strict=True)]
    return DecoderLM(whole, cfg.vocab_size, d, layers, RMSNorm(d, cfg.norm_eps),
                     cfg.tie_word_embeddings)


RENAMES = [
    (r"^model\.embedding_norm\.", "model.norm."),
    (r"^(model\.layers\.\d+)\.operator_norm\.", r"\1.input_layernorm."),
    (r"^(model\.layers\.\d+)\.ffn_norm\.", r"\1.post_attention_layernorm."),
    (r"^(model\.layers\.\d+)\.feed_forward\.w1\.", r"\1.mlp.gate_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.w3\.", r"\1.mlp.up_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.w2\.", r"\1.mlp.down_proj."),
    # LFM2-MoE's experts, one by one (the stacked form is split by the loader)
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.(\d+)\.w1\.",
     r"\1.mlp.experts.\2.gate_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.(\d+)\.w3\.",
     r"\1.mlp.experts.\2.up_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.(\d+)\.w2\.",
     r"\1.mlp.experts.\2.down_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.expert_bias$", r"\1.mlp.gate.expert_bias"),
    (r"^(model\.layers\.\d+)\.feed_forward\.", r"\1.mlp."),
    (r"^(model\.layers\.\d+)\.self_attn\.out_proj\.", r"\1.mixer.o_proj."),
    (r"^(model\.layers\.\d+)\.self_attn\.q_layernorm\.", r"\1.mixer.q_norm."),
    (r"^(model\.layers\.\d+)\.self_attn\.k_layernorm\.", r"\1.mixer.k_norm."),
    (r"^(model\.layers\.\d+)\.(?:self_attn|conv)\.", r"\1.mixer."),
]


_renames = renamer(RENAMES)


def rename(name: str) -> str | None:
    """A checkpoint tensor's name in :func:`build`'s module (``lfm2_vl``'s text model too)."""
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    elif name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        return None
    return _renames(name)


def describe(cfg: Lfm2Config) -> str:
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    return (f"lfm2 (short convolutions + GQA attention, {attn} of {len(cfg.layer_types)} "
            "layers attention)")


FAMILY = HFFamily(Lfm2Config.from_hf, build, rename, describe)
