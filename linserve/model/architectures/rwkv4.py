"""RWKV-4 (``rwkv``: transformers' ``RwkvForCausalLM``, ``RWKV/rwkv-4-*-pile``, and BlinkDL's
``.pth`` of RWKV-4 through :mod:`linserve.model.architectures.rwkv_pth`): per layer a
LayerNorm, the time mix (:mod:`linserve.model.layers.rwkv4`), a LayerNorm, the channel mix;
a LayerNorm on the embeddings, folded into the table once loaded; a LayerNorm and an untied
head. The residual is halved every ``rescale_every`` layers as transformers does in eval
mode (:mod:`linserve.model.layers.rwkv_block`). State per layer: the time mix's numerator,
denominator and largest exponent ``[3, A]`` and two token shifts ``[d]``, constant in size.

The tensor names here are the Hugging Face ones (``rwkv.blocks.N.attention.*``,
``rwkv.blocks.N.feed_forward.*``), which RWKV-6's folders share (:func:`rename`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.layers.rwkv4 import TimeMix4
from linserve.model.layers.rwkv6 import ChannelMix
from linserve.model.layers.rwkv_block import RwkvBlock, RwkvLM, rescaling


@dataclass(frozen=True, kw_only=True)
class Rwkv4Config(DecoderConfig):
    num_hidden_layers: int
    attention_hidden_size: int
    intermediate_size: int
    layer_norm_epsilon: float
    rescale_every: int
    rescaled: bool  # the output weights were divided when written (never, from transformers)

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Rwkv4Config:
        d = int(c["hidden_size"])
        return cls(**DecoderConfig.shared({**c, "max_position_embeddings": int(
                       c.get("context_length") or 1_048_576)}, 1_048_576, False),
                   num_hidden_layers=int(c["num_hidden_layers"]),
                   attention_hidden_size=int(c.get("attention_hidden_size") or d),
                   intermediate_size=int(c.get("intermediate_size") or 4 * d),
                   layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)),
                   rescale_every=int(c.get("rescale_every", 6) or 0),
                   rescaled=bool(c.get("rescaled_weights", False)))


class Rwkv4LM(RwkvLM):
    """The whole model (:class:`RwkvLM`'s body, RWKV-4's mixers)."""

    def __init__(self, cfg: Rwkv4Config) -> None:
        d, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        rescale = rescaling(cfg.num_hidden_layers, cfg.rescale_every, cfg.rescaled)
        super().__init__(cfg, [RwkvBlock(d, eps, TimeMix4(d, cfg.attention_hidden_size),
                                         ChannelMix(d, cfg.intermediate_size, "mix"), i,
                                         **rescale[i])
                               for i in range(cfg.num_hidden_layers)], eps)


_B, _TO = r"^rwkv\.blocks\.(\d+)\.", r"model.layers.\1."
# the Hugging Face layout (transformers' RWKV-4, the RWKV-6 folders, llama.cpp's converter's
# names through gguf-py's map) to the modules here
rename = renamer([
    (_B + r"pre_ln\.", _TO + "pre_norm."),
    (_B + r"ln1\.", _TO + "attn_norm."),
    (_B + r"ln2\.", _TO + "ffn_norm."),
    (_B + r"attention\.", _TO + "attn."),
    (_B + r"feed_forward\.", _TO + "ffn."),
    (r"^rwkv\.embeddings\.", "model.embed_tokens."),
    (r"^rwkv\.ln_out\.", "model.norm."),
    (r"^head\.", "lm_head."),
])


def describe(cfg: Rwkv4Config) -> str:
    return f"rwkv4 (RWKV-4, {cfg.num_hidden_layers} layers of {cfg.hidden_size})"


FAMILY = HFFamily(Rwkv4Config.from_hf, Rwkv4LM, rename, describe)
