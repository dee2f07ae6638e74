"""RWKV-6 "Finch" (``rwkv6``: the Hugging Face folders ``RWKV/v6-Finch-*-HF``, BlinkDL's
``.pth`` through :mod:`linserve.model.architectures.rwkv_pth`, and llama.cpp's GGUF
``rwkv6``): per layer a LayerNorm, the time mix (:mod:`linserve.model.layers.rwkv6`), a
LayerNorm, the channel mix; a LayerNorm on the embeddings, folded into the table once
loaded; a LayerNorm and an untied head. The residual is halved every ``rescale_every`` layers
as the folders' modeling code (in eval mode) and llama.cpp's graph do
(:mod:`linserve.model.layers.rwkv_block`); a ``.pth`` never is (BlinkDL's fp32 reference).
State per layer: S ``[H, N, N]`` (value × key) and two token shifts ``[d]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily
from linserve.model.architectures.hf import Index
from linserve.model.architectures.rwkv4 import rename
from linserve.model.layers.rwkv6 import MIXES, ChannelMix, Rwkv6Shape, TimeMix6
from linserve.model.layers.rwkv_block import RwkvBlock, RwkvStateFileLM, rescaling


@dataclass(frozen=True, kw_only=True)
class Rwkv6Config(DecoderConfig):
    num_hidden_layers: int
    head_size: int
    intermediate_size: int
    time_mix_extra_dim: int
    time_decay_extra_dim: int
    layer_norm_epsilon: float
    rescale_every: int
    rescaled: bool  # the output weights were divided when written (llama.cpp's files)

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Rwkv6Config:
        d = int(c["hidden_size"])
        head = int(c.get("head_size") or 64)
        if d % head or int(c.get("attention_hidden_size") or d) != d:
            raise ValueError(f"hidden_size {d} with head_size {head} and attention_hidden_size "
                             f"{c.get('attention_hidden_size')} is not an RWKV-6 layout")
        big = d == 4096  # the modeling code's (and the converter's) LoRA ranks
        return cls(**DecoderConfig.shared({**c, "max_position_embeddings": 1_048_576},
                                          1_048_576, False),
                   num_hidden_layers=int(c["num_hidden_layers"]), head_size=head,
                   intermediate_size=int(c.get("intermediate_size") or (d * 7 // 2) // 32 * 32),
                   time_mix_extra_dim=int(c.get("time_mix_extra_dim") or (64 if big else 32)),
                   time_decay_extra_dim=int(c.get("time_decay_extra_dim")
                                            or (128 if big else 64)),
                   layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)),
                   rescale_every=int(c.get("rescale_every", 6) or 0),
                   rescaled=bool(c.get("rescaled_weights", False)))

    @property
    def shape(self) -> Rwkv6Shape:
        return Rwkv6Shape(self.hidden_size, self.head_size, self.time_mix_extra_dim,
                          self.time_decay_extra_dim, self.intermediate_size)


class Rwkv6LM(RwkvStateFileLM):
    """The whole model (:class:`RwkvLM`'s body, RWKV-6's mixers)."""

    version = "RWKV-6"

    def __init__(self, cfg: Rwkv6Config) -> None:
        sh, eps = cfg.shape, cfg.layer_norm_epsilon
        rescale = rescaling(cfg.num_hidden_layers, cfg.rescale_every, cfg.rescaled)
        super().__init__(cfg, [RwkvBlock(sh.hidden, eps, TimeMix6(sh),
                                         ChannelMix(sh.hidden, sh.intermediate, "maa"), i,
                                         **rescale[i])
                               for i in range(cfg.num_hidden_layers)], eps)


def split_lerps(name: str, shape: tuple[int, ...]) -> list[tuple[str, Index]] | None:
    """llama.cpp's converter's stacked lerps ``[5, 1, 1, d]`` as ``time_maa_{w,k,v,r,g}``."""
    if not name.endswith(".attn.time_maa_fused") or shape[0] != len(MIXES):
        return None
    prefix = name.removesuffix("fused")
    return [(prefix + m, (i,)) for i, m in enumerate(MIXES)]


def describe(cfg: Rwkv6Config) -> str:
    return (f"rwkv6 (RWKV-6 Finch, {cfg.num_hidden_layers} layers, "
            f"{cfg.hidden_size // cfg.head_size} heads of {cfg.head_size})")


FAMILY = HFFamily(Rwkv6Config.from_hf, Rwkv6LM, rename, describe,
                  split_for=lambda cfg: split_lerps)
