"""LFM3 (``lfm3``, ``Lfm3ForCausalLM``): LFM2's double-gated short convolutions (a window of
``conv_L_cache``, wider than LFM2's), sliding-window attention over the last
``sliding_window`` tokens (a ring of keys, constant) and full attention, each with q/k
RMSNorm per head and a sigmoid output gate per head (``use_attention_gate``), and rotary
positions per layer type (``rope_parameters``: the sliding layers' default, the full
layers' "proportional" half); a SwiGLU MLP; sandwich norms (``use_sandwich_norm``): each
part's output normed before it joins the residual. State: a conv window per conv layer and a
ring per sliding layer (both constant), a KV cache per full-attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures import lfm2
from linserve.model.architectures.family import DecoderConfig, HFFamily, layer_types, renamer
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.short_conv import ShortConv

KINDS = ("conv", "sliding_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class Lfm3Config(DecoderConfig):
    intermediate_size: int
    layer_types: tuple[str, ...]  # KINDS
    attention: dict[str, AttentionShape]  # per attention layer type
    norm_eps: float
    conv_width: int
    conv_bias: bool
    sandwich: bool

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Lfm3Config:
        d = int(c["hidden_size"])
        types = layer_types(c, tuple(KINDS))
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or d // heads)
        eps = float(c.get("norm_eps", 1e-5))
        ropes = c.get("rope_parameters") or {}
        shapes = {kind: _attention(c, ropes.get(kind) or {}, heads, head_dim, eps,
                                   int(c.get("sliding_window") or 0) if kind == KINDS[1] else 0)
                  for kind in KINDS[1:]}
        return cls(**DecoderConfig.shared(c, 128_000, True),
                   intermediate_size=int(c["intermediate_size"]), layer_types=types,
                   attention=shapes, norm_eps=eps, conv_width=int(c.get("conv_L_cache", 7)),
                   conv_bias=bool(c.get("conv_bias", False)),
                   sandwich=bool(c.get("use_sandwich_norm", True)))


def _attention(c: dict[str, Any], rope: dict[str, Any], heads: int, head_dim: int, eps: float,
               window: int) -> AttentionShape:
    """One attention layer type's shape from its ``rope_parameters`` entry."""
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(f"rope_type {kind!r} is not served")
    if float(rope.get("factor", 1.0)) != 1.0:
        raise ValueError("a RoPE factor is not served")
    partial = float(rope.get("partial_rotary_factor", 1.0))
    bias = bool(c.get("attention_bias", False))
    return AttentionShape(int(c["hidden_size"]), heads, int(c["num_key_value_heads"]), head_dim,
                          rotary_dim=int(head_dim * partial),
                          rope_theta=float(rope.get("rope_theta", 10_000.0)), qk_norm=True,
                          eps=eps, bias=bias, out_bias=bias, window=window,
                          head_gate=bool(c.get("use_attention_gate", True)),
                          proportional=kind == "proportional")


def build(cfg: Lfm3Config) -> DecoderLM:
    d = cfg.hidden_size
    layers = [Block(ShortConv(d, cfg.conv_width, cfg.conv_bias) if kind == "conv"
                    else Attention(cfg.attention[kind]),
                    SwiGLU(d, cfg.intermediate_size), RMSNorm, d, cfg.norm_eps,
                    sandwich=cfg.sandwich)
              for kind in cfg.layer_types]
    return DecoderLM(cfg, cfg.vocab_size, d, layers, RMSNorm(d, cfg.norm_eps),
                     cfg.tie_word_embeddings)


RENAMES = [
    (r"^(model\.layers\.\d+)\.post_operator_norm\.", r"\1.post_mixer_norm."),
    (r"^(model\.layers\.\d+)\.post_ffn_norm\.", r"\1.post_mlp_norm."),
    (r"^(model\.layers\.\d+)\.self_attn\.(?:gate_proj|g_proj)\.", r"\1.mixer.g_proj."),
    *lfm2.RENAMES,
]


def describe(cfg: Lfm3Config) -> str:
    counts = {kind: cfg.layer_types.count(kind) for kind in KINDS}
    return (f"lfm3 (short convolutions {counts['conv']}, sliding attention "
            f"{counts['sliding_attention']} (window {cfg.attention[KINDS[1]].window}), full "
            f"attention {counts['full_attention']} layers)")


FAMILY = HFFamily(Lfm3Config.from_hf, build, renamer(RENAMES), describe)
