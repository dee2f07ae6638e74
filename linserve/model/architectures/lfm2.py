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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from linserve.model import modes
from linserve.model.architectures import hf
from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.inputs import Encoder
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.hf_keys import rope_theta
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.short_conv import ShortConv
from linserve.model.vision.lfm2_prep import Lfm2ImageSpec
from linserve.model.vision.siglip2_tower import (
    Lfm2ImageEncoder,
    Projector,
    SiglipConfig,
    SiglipTower,
)


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
    vision: SiglipConfig | None = None  # LFM2-VL's tower and projector (None: text only)
    image: Lfm2ImageSpec | None = None  # how its images become tokens (set with the path)

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Lfm2Config:
        """Read an ``lfm2`` config, or the ``text_config`` of an ``lfm2_vl`` one with its
        ``vision_config``."""
        if c.get("model_type") == "lfm2_vl":
            text = {"tie_embedding": c.get("tie_word_embeddings", True), **c["text_config"]}
            cfg = cls.from_hf(text)
            return dataclasses.replace(cfg, vision=SiglipConfig.from_hf(c, cfg.hidden_size))
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


class Lfm2VlLM(DecoderLM):
    """LFM2 with LFM2-VL's vision tower and projector (``vision_tower``,
    ``multi_modal_projector``): its images are items whose rows the tower makes
    (:class:`Lfm2ImageEncoder`); positions stay 1-D."""

    def attach(self, vision: SiglipConfig) -> None:
        self.vision_tower = SiglipTower(vision)
        self.multi_modal_projector = Projector(vision)

    def image_encoder(self) -> Lfm2ImageEncoder | None:
        image = self.cfg.image
        if image is None or not hasattr(self, "vision_tower"):
            return None
        return Lfm2ImageEncoder(self.vision_tower, self.multi_modal_projector, image,
                                lambda ids: self.embed(ids[None])[0])

    def encoders(self) -> dict[str, Encoder]:
        encoder = self.image_encoder()
        return {} if encoder is None else {"image": encoder}

    def prepare(self, fused: bool) -> bool:
        """The tower's weights packed as the layers' are (one tile of zeros), then the
        decoder's."""
        encoder = self.image_encoder()
        if encoder is not None:
            side = encoder.spec.patch * encoder.spec.downsample
            encoder.features(torch.zeros(3, side, side, dtype=torch.uint8))
        return super().prepare(fused)


def build(cfg: Lfm2Config) -> DecoderLM:
    model = build_with(cfg, cfg, [SwiGLU(cfg.hidden_size, cfg.ff_size)
                                  for _ in cfg.layer_types],
                       Lfm2VlLM if cfg.vision is not None else DecoderLM)
    if isinstance(model, Lfm2VlLM) and cfg.vision is not None:
        model.attach(cfg.vision)
    return model


def build_with(cfg: Lfm2Config, whole: Any, mlps: list[nn.Module],
               cls: type[DecoderLM] = DecoderLM) -> DecoderLM:
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
    return cls(whole, cfg.vocab_size, d, layers, RMSNorm(d, cfg.norm_eps),
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


def rename_for(cfg: Lfm2Config) -> Callable[[str], str | None]:
    """:func:`rename`, with LFM2-VL's tower and projector read where the config has them."""
    if cfg.vision is None:
        return rename

    def with_tower(name: str) -> str | None:
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            return name.removeprefix("model.")
        return rename(name)

    return with_tower


def with_images(cfg: Lfm2Config, path: Path) -> Lfm2Config:
    """An LFM2-VL config with its image spec (the folder's processor config and markers),
    or without its tower where images are not wanted or the checkpoint has none."""
    if cfg.vision is None:
        return cfg
    if hf.is_gguf(path) or not modes.images_wanted() or not any(
            n.startswith("model.vision_tower.") for n in hf.tensor_files(path)):
        return dataclasses.replace(cfg, vision=None, image=None)
    spec = Lfm2ImageSpec.from_checkpoint(path, hf.config_json(path))
    return dataclasses.replace(cfg, image=spec.with_limits(modes.image_limits()))


def describe(cfg: Lfm2Config) -> str:
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    tower = "" if cfg.vision is None else f"; a SigLIP2 tower of {cfg.vision.layers} layers"
    return (f"lfm2{'_vl' if cfg.vision is not None else ''} (short convolutions + GQA "
            f"attention, {attn} of {len(cfg.layer_types)} layers attention{tower})")


FAMILY = HFFamily(Lfm2Config.from_hf, build, rename, describe, rename_for=rename_for,
                  config_for=with_images)
