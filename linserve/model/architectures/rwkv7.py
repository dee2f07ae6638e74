"""RWKV-7 "Goose" (``rwkv7``: fla-hub's ``RWKV7ForCausalLM`` folders, and BlinkDL's ``.pth``
files through :mod:`linserve.model.architectures.rwkv_pth`): per layer a LayerNorm, the time
mix, a LayerNorm, the channel mix (:mod:`linserve.model.layers.rwkv7`); a LayerNorm on the
embeddings (folded into the table once loaded, as BlinkDL's reference does); a LayerNorm and an
untied head. State per layer: S ``[H, N, N]`` and two token shifts ``[d]``, constant in size.

Layer 0's value (v₁) is mixed into every later layer's: :meth:`Rwkv7LM._run` carries it from
layer to layer, as the native step's plan carries it in a slot (``carry``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.architectures.hf import Index
from linserve.model.layers.block import LayerPart
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.rwkv7 import ChannelMix7, Rwkv7Shape, TimeMix7
from linserve.model.state import RecurrentEntry, State, StateError


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


class Rwkv7Block(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + ffn(ffn_norm(x))`` (fla's ``RWKV7Block``; layer
    0's ``pre_norm`` is the embeddings' LayerNorm, folded into the table by
    :meth:`Rwkv7LM.prepare`)."""

    def __init__(self, sh: Rwkv7Shape, index: int) -> None:
        super().__init__()
        if index == 0:
            self.pre_norm = nn.LayerNorm(sh.hidden, eps=sh.norm_eps)
        self.attn_norm = nn.LayerNorm(sh.hidden, eps=sh.norm_eps)
        self.attn = TimeMix7(sh, first=index == 0)
        self.ffn_norm = nn.LayerNorm(sh.hidden, eps=sh.norm_eps)
        self.ffn = ChannelMix7(sh)

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        del max_context
        return {**self.attn.new_entries(batch), **self.ffn.new_entries(batch)}

    def native_parts(self) -> tuple[LayerPart, LayerPart]:
        return LayerPart(self.attn, self.attn_norm), LayerPart(self.ffn, self.ffn_norm)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None,
                carry: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``[B, T, d]`` (or ``[B, d]`` with ``one_token``) -> the same; ``carry`` holds v₁
        from layer 0 on (None: a layer run alone, as when its weights are packed)."""
        carry = {} if carry is None else carry
        if one_token:
            return self.forward(x.unsqueeze(1), entries, lengths, carry=carry).squeeze(1)
        x = x + self.attn(self.attn_norm(x), entries, new, carry)
        return x + self.ffn(self.ffn_norm(x), entries, new)


class Rwkv7LM(DecoderLM):
    """The whole model on the shared decoder body (:class:`DecoderLM`); see the module
    docstring."""

    def __init__(self, cfg: Rwkv7Config) -> None:
        sh = cfg.shape
        super().__init__(cfg, cfg.vocab_size, cfg.hidden_size,
                         [Rwkv7Block(sh, i) for i in range(cfg.num_hidden_layers)],
                         nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps), False)

    def _run(self, x: torch.Tensor, state: State, one_token: bool = False,
             new: torch.Tensor | None = None, lengths: torch.Tensor | None = None
             ) -> torch.Tensor:
        carry: dict[str, torch.Tensor] = {}
        lengths = state.lengths if lengths is None else lengths
        for layer, entries in zip(self.model.layers, state.layers, strict=True):
            x = layer(x, entries, lengths, one_token=one_token, new=new, carry=carry)
        return x

    @torch.no_grad()
    def fold_embedding_norm(self) -> None:
        """The embeddings' LayerNorm applied to the table once, in fp32 (BlinkDL's reference
        does the same at load), then dropped."""
        first = self.model.layers[0]
        norm = getattr(first, "pre_norm", None)
        if norm is None:
            return
        table = self.model.embed_tokens.weight
        table.copy_(F.layer_norm(table.float(), (table.shape[1],), norm.weight.float(),
                                 norm.bias.float(), norm.eps).to(table.dtype))
        del first.pre_norm

    def prepare(self, fused: bool) -> bool:
        self.fold_embedding_norm()
        return super().prepare(fused)

    def state_from_file(self, tensors: dict[str, torch.Tensor], state: State) -> None:
        """A state-tuned ``.pth`` (``blocks.{i}.att.time_state`` ``[H, N, N]`` per layer, in
        BlinkDL's value × key orientation, as v7's are written) into a fresh one-row
        ``state`` (the token shifts stay zero). Raises :class:`StateError`."""
        expected = {f"blocks.{i}.att.time_state" for i in range(self.cfg.num_hidden_layers)}
        if set(tensors) != expected:
            extra = sorted(set(tensors) ^ expected)
            raise StateError(f"an RWKV-7 state file of {len(expected)} layers holds "
                             f"blocks.N.att.time_state, each once (not {extra[0]})")
        for i, entries in enumerate(state.layers):
            s = cast(RecurrentEntry, entries["recurrent"]).s
            t = tensors[f"blocks.{i}.att.time_state"]
            if tuple(t.shape) != tuple(s.shape[1:]):
                raise StateError(f"blocks.{i}.att.time_state has shape {tuple(t.shape)}, the "
                                 f"model's is {tuple(s.shape[1:])}")
            s[0].copy_(t.float())

    def state_to_file(self, state: State) -> dict[str, torch.Tensor]:
        """Row 0 of ``state`` as a state file (its S per layer; RWKV-Runner's format)."""
        return {f"blocks.{i}.att.time_state": cast(RecurrentEntry, entries["recurrent"]).s[0]
                .clone() for i, entries in enumerate(state.layers)}


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
