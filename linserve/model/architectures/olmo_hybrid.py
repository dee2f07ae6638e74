"""OLMo-Hybrid (``olmo_hybrid``, ``OlmoHybridForCausalLM``): Gated DeltaNet layers (pre-norm,
as Llama's) and full-attention layers as OLMo 3 builds them (post-norm: each part's output
normed before it joins the residual, no norm before it; q/k RMSNorm over all heads at once;
rotary positions, or none where the checkpoint gives no ``rope_theta``, as the released ones
do); a SwiGLU MLP in every layer. Its Gated DeltaNet projects q, k, v, the gate, a and b apart
and, with ``linear_allow_neg_eigval``, lets β = 2·sigmoid(b) reach (0, 2). State: an S and a
conv window per linear layer (constant), a KV cache per attention layer."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from linserve.model.architectures import hf
from linserve.model.architectures.family import (
    DecoderConfig,
    HFFamily,
    layer_types,
    require_activation,
)
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.gated_delta import DeltaMixer, DeltaShape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class OlmoHybridConfig(DecoderConfig):
    intermediate_size: int
    layer_types: tuple[str, ...]
    attention: AttentionShape
    delta: DeltaShape
    eps: float

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> OlmoHybridConfig:
        require_activation(c)
        d = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        types = layer_types(c, (LINEAR, FULL))
        head_dim = int(c.get("head_dim") or d // heads)
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not served")
        eps = float(c.get("rms_norm_eps", 1e-6))
        bias = bool(c.get("attention_bias", False))
        attn = AttentionShape(d, heads, int(c.get("num_key_value_heads") or heads), head_dim,
                              rotary_dim=head_dim if rope.get("rope_theta") is not None else 0,
                              rope_theta=float(rope.get("rope_theta") or 10_000.0),
                              qk_norm=True, eps=eps, bias=bias, out_bias=bias,
                              qk_norm_whole=True)
        kh = int(c.get("linear_num_key_heads") or heads)
        vh = int(c.get("linear_num_value_heads") or heads)
        if vh % kh:
            raise ValueError(f"linear_num_value_heads {vh} is not a multiple of "
                             f"linear_num_key_heads {kh}")
        dk = int(c.get("linear_key_head_dim") or int(0.75 * d / kh))
        delta = DeltaShape(d, kh, vh, dk, int(c.get("linear_value_head_dim") or 2 * dk),
                           int(c.get("linear_conv_kernel_dim", 4)), 1e-5, separate_qkv=True,
                           beta_scale=2.0 if c.get("linear_allow_neg_eigval", True) else 1.0)
        return cls(**DecoderConfig.shared(c, 65_536, False),
                   intermediate_size=int(c["intermediate_size"]), layer_types=types,
                   attention=attn, delta=delta, eps=eps)


def build(cfg: OlmoHybridConfig) -> DecoderLM:
    d = cfg.hidden_size
    layers = [Block(DeltaMixer(cfg.delta), SwiGLU(d, cfg.intermediate_size), RMSNorm, d, cfg.eps)
              if kind == LINEAR else
              Block(Attention(cfg.attention), SwiGLU(d, cfg.intermediate_size), RMSNorm, d,
                    cfg.eps, pre_norms=False)
              for kind in cfg.layer_types]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.eps),
                     cfg.tie_word_embeddings)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# a linear layer's Gated DeltaNet: OLMo-Hybrid's names to the shared layer's
_DELTA = {"q_proj": "in_proj_q", "k_proj": "in_proj_k", "v_proj": "in_proj_v",
          "g_proj": "in_proj_z", "a_proj": "in_proj_a", "b_proj": "in_proj_b",
          "o_proj": "out_proj", "o_norm": "norm"}
# the norms, by layer kind: the published names (``attention_layer_norm``,
# ``feedforward_layer_norm``, as transformers saves them too) and transformers' own
_NORMS = {
    LINEAR: {"attention_layer_norm": "input_layernorm", "input_layernorm": "input_layernorm",
             "feedforward_layer_norm": "post_attention_layernorm",
             "post_attention_layernorm": "post_attention_layernorm"},
    FULL: {"feedforward_layer_norm": "post_mixer_norm",
           "post_attention_layernorm": "post_mixer_norm",
           "post_feedforward_layernorm": "post_mlp_norm"},
}


def renames(cfg: OlmoHybridConfig) -> Callable[[str], str | None]:
    """Checkpoint names to ours: ``linear_attn`` to the mixer's ``delta`` (its q, k and v
    kernels stored apart, as published), ``self_attn`` to the mixer, the norms per layer
    kind."""

    def rename(name: str) -> str | None:
        hit = _LAYER.match(name)
        if hit is None:
            return name
        i, rest = hit.group(1), hit.group(2)
        head, _, tail = rest.partition(".")
        if head == "linear_attn":
            part, _, leaf = tail.partition(".")
            return f"model.layers.{i}.mixer.delta.{_DELTA.get(part, part)}.{leaf}".rstrip(".")
        if head == "self_attn":
            return f"model.layers.{i}.mixer.{tail}"
        norms = _NORMS[cfg.layer_types[int(i)]]
        return f"model.layers.{i}.{norms[head]}.{tail}" if head in norms else name

    return rename


def describe(cfg: OlmoHybridConfig) -> str:
    full = cfg.layer_types.count(FULL)
    return (f"olmo_hybrid (Gated DeltaNet {len(cfg.layer_types) - full}, attention {full} "
            "layers)")


def stored_conv_split(cfg: OlmoHybridConfig, path: Path) -> OlmoHybridConfig:
    """The config with the conv kernels' widths as the checkpoint stores them: transformers
    5.23 saves the fused ``[2 key + value]`` kernel as three equal thirds (and reads it
    back so); published checkpoints store q, k and v at their own widths."""
    if LINEAR not in cfg.layer_types or hf.is_gguf(path):
        return cfg
    first = cfg.layer_types.index(LINEAR)
    name = f"model.layers.{first}.linear_attn.k_conv1d.weight"
    shape = hf.tensor_shape(path, name)
    conv = cfg.delta.conv_dim
    if shape is None or shape[0] == cfg.delta.key_heads * cfg.delta.head_k_dim \
            or 3 * shape[0] != conv:
        return cfg  # as published (or not this layout: the check names the mismatch)
    return dataclasses.replace(cfg, delta=dataclasses.replace(
        cfg.delta, conv_split=(conv // 3, conv // 3, conv // 3)))


FAMILY = HFFamily(OlmoHybridConfig.from_hf, build, lambda n: n, describe,
                  rename_for=renames, config_for=stored_conv_split)
