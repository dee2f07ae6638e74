"""RWKV-7 "Goose" (``rwkv7``: fla-hub's ``RWKV7ForCausalLM`` folders, and BlinkDL's ``.pth``
files through :mod:`linserve.model.architectures.rwkv_pth`): per layer a LayerNorm, the time
mix, a LayerNorm, the channel mix (:mod:`linserve.model.layers.rwkv7`); a LayerNorm on the
embeddings (folded into the table once loaded, as BlinkDL's reference does); a LayerNorm and an
untied head. State per layer: S ``[H, N, N]`` and two token shifts ``[d]``, constant in size.

Layer 0's value (v₁) is mixed into every later layer's: the model's ``_run`` carries it from
layer to layer, as the native step's plan carries it in a slot (``carry``). The block, the
embeddings' LayerNorm and state files are every RWKV's (:mod:`linserve.model.layers.rwkv_block`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.architectures.hf import Index
from linserve.model.layers.rwkv7 import ChannelMix7, Rwkv7Shape, TimeMix7
from linserve.model.layers.rwkv_block import RwkvBlock, RwkvStateFileLM


@dataclass(frozen=True, kw_only=True)
class Rwkv7Config(DecoderConfig):
    num_hidden_layers: int
    head_dim: int
    decay_low_rank_dim: int
    a_low_rank_dim: int
    v_low_rank_dim: int
    gate_low_rank_dim: int
    intermediate_size: int
    norm_eps: float
    group_norm_eps: float  # fla's head_dim·norm_eps; a .pth's BlinkDL's 64e-5

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Rwkv7Config:
        d = int(c["hidden_size"])
        head = int(c.get("head_dim") or 64)
        if d % head:
            raise ValueError(f"hidden_size {d} is not a multiple of head_dim {head}")
        if c.get("attn"):
            raise NotImplementedError("RWKV-7 with attention layers (fla's hybrid) is not served")
        if not c.get("norm_bias", True):
            raise NotImplementedError("RWKV-7 without LayerNorm biases is not served")
        if any(int(v) != d for v in c.get("value_dim") or []):
            raise NotImplementedError("RWKV-7 with value_dim other than hidden_size")
        eps = float(c.get("norm_eps", 1e-5))
        inter = c.get("intermediate_size")
        if inter is None:
            inter = 32 * ((int(d * float(c.get("hidden_ratio") or 4)) + 31) // 32)
        return cls(**DecoderConfig.shared(c, 1_048_576, False),
                   num_hidden_layers=int(c["num_hidden_layers"]), head_dim=head,
                   decay_low_rank_dim=int(c["decay_low_rank_dim"]),
                   a_low_rank_dim=int(c["a_low_rank_dim"]),
                   v_low_rank_dim=int(c["v_low_rank_dim"]),
                   gate_low_rank_dim=int(c["gate_low_rank_dim"]),
                   intermediate_size=int(inter), norm_eps=eps,
                   group_norm_eps=float(c.get("group_norm_eps", head * eps)))

    @property
    def shape(self) -> Rwkv7Shape:
        return Rwkv7Shape(self.hidden_size, self.head_dim, self.decay_low_rank_dim,
                          self.a_low_rank_dim, self.v_low_rank_dim, self.gate_low_rank_dim,
                          self.intermediate_size, self.norm_eps, self.group_norm_eps)


class Rwkv7LM(RwkvStateFileLM):
    """The whole model (:class:`RwkvLM`'s body, RWKV-7's mixers); v₁ crosses layers in
    ``carry``, as the native step's plan carries it in a slot."""

    version = "RWKV-7"

    def __init__(self, cfg: Rwkv7Config) -> None:
        sh = cfg.shape
        super().__init__(cfg, [RwkvBlock(sh.hidden, sh.norm_eps, TimeMix7(sh, first=i == 0),
                                         ChannelMix7(sh), i)
                               for i in range(cfg.num_hidden_layers)], cfg.norm_eps)


# llama.cpp's converter's names (GGUF, through gguf-py's map) to fla-hub's; a layer-0 v
# LoRA is the converter's dummy copy of a's (layer 0 has none)
_L, _A, _TO = r"^model\.layers\.(\d+)\.", r"^model\.layers\.(\d+)\.attention\.", r"model.layers.\1."
_W = r"(\.weight)?$"  # the converter's name of a vector, with or without its suffix
_GGUF_NAMES = renamer([
    (r"^model\.layers\.0\.attention\.v[012]" + _W, ""),
    (_A + r"([wav])0" + _W, _TO + r"attn.\2_lora.lora.2.bias"),
    (_A + r"([wavg])1\.weight$", _TO + r"attn.\2_lora.lora.0.weight"),
    (_A + r"([wavg])2\.weight$", _TO + r"attn.\2_lora.lora.2.weight"),
    (_A + r"(k_k|k_a|r_k)" + _W, _TO + r"attn.\2"),
    (_A + r"receptance\.", _TO + "attn.r_proj."),
    (_A + r"key\.", _TO + "attn.k_proj."),
    (_A + r"value\.", _TO + "attn.v_proj."),
    (_A + r"output\.", _TO + "attn.o_proj."),
    (_A + r"ln_x\.", _TO + "attn.g_norm."),
    (_L + r"ln1\.", _TO + "attn_norm."),
    (_L + r"ln2\.", _TO + "ffn_norm."),
    (_L + r"feed_forward\.x_k" + _W, _TO + "ffn.x_k"),
    (_L + r"feed_forward\.(key|value)\.", _TO + r"ffn.\2."),
    (r"^model\.embeddings\.", "model.embed_tokens."),
])
MIX_ROWS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def rename(name: str) -> str | None:
    """An fla-hub tensor's name (or llama.cpp's converter's, from a GGUF file) in
    :class:`Rwkv7LM` (None: a tensor the model does not use)."""
    return _GGUF_NAMES(name) or None


def split_lerps(name: str, shape: tuple[int, ...]) -> list[tuple[str, Index]] | None:
    """The converter's stacked lerps ``[6, 1, 1, d]`` (``x_fused``) as the six ``x_*``."""
    if not name.endswith(".attn.x_fused") or shape[0] != len(MIX_ROWS):
        return None
    prefix = name.removesuffix("x_fused")
    return [(prefix + m, (i,)) for i, m in enumerate(MIX_ROWS)]


def describe(cfg: Rwkv7Config) -> str:
    return (f"rwkv7 (RWKV-7 Goose, {cfg.num_hidden_layers} layers, "
            f"{cfg.hidden_size // cfg.head_dim} heads of {cfg.head_dim})")


FAMILY = HFFamily(Rwkv7Config.from_hf, Rwkv7LM, rename, describe,
                  split_for=lambda cfg: split_lerps)
