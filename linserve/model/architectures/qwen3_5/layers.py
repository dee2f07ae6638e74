"""Qwen3.5's layers, shared by the text model (:mod:`.model`) and its MTP layers (:mod:`.mtp`).

Shapes: B rows, T tokens, d = hidden_size.

- Gated DeltaNet: the shared layer of :mod:`linserve.model.layers.gated_delta`. State per layer: a
  :class:`RecurrentEntry` S ``[B, Hv, Dk, Dv]`` and a :class:`ConvEntry` of the last K−1
  projections.
- Gated attention (:class:`GatedAttention`): q (with an output gate per head), k, v; RMSNorm
  on q and k per head; rotary positions on the first ``partial_rotary_factor`` of each head;
  grouped-query attention; output × sigmoid(gate). State: a :class:`KVEntry`.
- SwiGLU MLP, and Qwen's RMSNorm with weights stored as w − 1 (it scales by 1 + w).

:meth:`DecoderLayer.native_parts` describes a layer to the whole-model native step
(:mod:`linserve.model.layers.native_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from linserve.model import invariant, packing
from linserve.model.architectures.family import DecoderConfig
from linserve.model.architectures.qwen3_5 import mrope
from linserve.model.invariant import Linear
from linserve.model.layers.block import LayerPart
from linserve.model.layers.gated_delta import DeltaShape, GatedDeltaNet
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.moe import RouterSpec, SparseMoE
from linserve.model.layers.norms import RMSNorm
from linserve.model.layers.rope import inv_freq as rope_freqs
from linserve.model.layers.rope import rope as shared_rope
from linserve.model.layers.step_parts import AttentionPart
from linserve.model.state import KVEntry, PositionEntry
from linserve.model.vision.qwen_prep import QwenImageSpec
from linserve.model.vision.qwen_tower import VisionConfig


@dataclass(frozen=True)
class QwenExperts:
    """The sparse MLP of Qwen3.5-MoE and Qwen3-Next: a softmax router over ``num_experts``,
    the top ``num_experts_per_tok`` renormalised (``norm_topk_prob``), SwiGLU experts of
    ``moe_intermediate_size``, and a shared expert of ``shared_expert_intermediate_size``
    gated by a sigmoid. ``sparse``: per layer, experts or the dense MLP (Qwen3-Next's
    ``decoder_sparse_step`` and ``mlp_only_layers``)."""

    router: RouterSpec
    expert_size: int
    shared_size: int
    sparse: tuple[bool, ...]

    @classmethod
    def from_hf(cls, text: dict[str, Any], layers: int) -> QwenExperts | None:
        experts = int(text.get("num_experts") or 0)
        if experts == 0:
            return None
        step = int(text.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in text.get("mlp_only_layers") or []}
        return cls(RouterSpec(experts, int(text["num_experts_per_tok"]),
                              norm_topk=bool(text.get("norm_topk_prob", True))),
                   int(text["moe_intermediate_size"]),
                   int(text.get("shared_expert_intermediate_size") or 0),
                   tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))


@dataclass(frozen=True, kw_only=True)
class Qwen35Config(DecoderConfig):
    """The text model's shape, from a Hugging Face ``config.json`` (see :meth:`from_hf`)."""

    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    experts: QwenExperts | None = None  # None: every layer's MLP dense
    mtp_layers: int = 0  # MTP layers the checkpoint carries (mtp.*; 0: none read)
    mrope_section: tuple[int, int, int] = (11, 11, 10)  # frequencies on t, row, column
    vision: VisionConfig | None = None  # the vision tower's (None: text only, or not loaded)
    image: QwenImageSpec | None = None  # how its images become tokens

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Qwen35Config:
        """Read a ``qwen3_5_text`` / ``qwen3_5_moe_text`` / ``qwen3_next`` config, or the
        ``text_config`` of a ``qwen3_5`` / ``qwen3_5_moe`` one. Raises ValueError (naming
        the field) for anything missing or inconsistent."""
        text = config.get("text_config", config) \
            if config.get("model_type") in ("qwen3_5", "qwen3_5_moe") else config
        tie = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        rope = text.get("rope_parameters") or {}
        n = int(text["num_hidden_layers"])
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0
            else "linear_attention" for i in range(n)]
        cfg = cls(
            **DecoderConfig.shared(text, 262_144, False),
            intermediate_size=int(text.get("intermediate_size") or 0), layer_types=tuple(types),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or text["hidden_size"] //
                         text["num_attention_heads"]),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 text.get("partial_rotary_factor", 0.25))),
            experts=QwenExperts.from_hf(text, n),
            mtp_layers=int(text.get("mtp_num_hidden_layers")
                           or text.get("num_nextn_predict_layers") or 0),
            mrope_section=_section(rope.get("mrope_section")),
            **_vision_fields(config)).tied(tie)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raise ValueError for an inconsistent shape."""
        if len(self.layer_types) == 0:
            raise ValueError("num_hidden_layers must be at least 1")
        bad = set(self.layer_types) - {"linear_attention", "full_attention"}
        if bad:
            raise ValueError(f"unknown layer_types {sorted(bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads is not a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads is not a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError("partial_rotary_factor gives an odd or oversized rotary dimension")
        dense = self.experts is None or not all(self.experts.sparse)
        if dense and self.intermediate_size <= 0:
            raise ValueError("intermediate_size is missing for the dense MLP layers")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def delta(self) -> DeltaShape:
        """The Gated DeltaNet layers' shape."""
        return DeltaShape(self.hidden_size, self.linear_num_key_heads,
                          self.linear_num_value_heads, self.linear_key_head_dim,
                          self.linear_value_head_dim, self.linear_conv_kernel_dim,
                          self.rms_norm_eps)


def _vision_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The vision tower's config and image spec of a ``qwen3_5`` (vision-language) config
    (none for a text model's)."""
    vision = config.get("vision_config")
    if config.get("model_type") != "qwen3_5" or not vision or "image_token_id" not in config:
        return {}
    return {"vision": VisionConfig.from_hf(vision),
            "image": QwenImageSpec(placeholder=int(config["image_token_id"]),
                                   patch=int(vision.get("patch_size", 16)),
                                   merge=int(vision.get("spatial_merge_size", 2)),
                                   temporal=int(vision.get("temporal_patch_size", 2)))}


def _section(value: Any) -> tuple[int, int, int]:
    """``rope_parameters.mrope_section`` (transformers' default where absent)."""
    v = [int(x) for x in (value or (11, 11, 10))]
    if len(v) != 3:
        raise ValueError(f"rope_parameters.mrope_section must have three entries, not {v}")
    return (v[0], v[1], v[2])


def qwen_norm(dim: int, eps: float) -> RMSNorm:
    """Qwen's RMSNorm, its weight stored as w − 1 (it scales by 1 + w)."""
    return RMSNorm(dim, eps, offset=1.0)


def inv_freq(cfg: Qwen35Config) -> torch.Tensor:
    """The rotary frequencies ``[rotary_dim / 2]`` fp32."""
    return rope_freqs(cfg.rotary_dim, cfg.rope_theta)


def rope(x: torch.Tensor, pos: torch.Tensor, cfg: Qwen35Config) -> torch.Tensor:
    """Rotary positions on the first ``rotary_dim`` of each head (halves rotated). x
    ``[B, H, T, D]``, pos ``[B, T]`` (or ``[1, T]``) int64, or ``[3, B, T]``: (t, row,
    column) positions (:mod:`.mrope`)."""
    return shared_rope(x, pos, inv_freq(cfg), mrope.axes(cfg.rotary_dim, cfg.mrope_section))


class GatedAttention(nn.Module):
    """Gated full attention with a KV cache (see the module docstring)."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.cfg = cfg
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, 2 * h * d, bias=False)
        self.k_proj = Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = qwen_norm(d, cfg.rms_norm_eps)
        self.k_norm = qwen_norm(d, cfg.rms_norm_eps)

    def qkv_weight(self) -> torch.Tensor:
        """q (with its gate), k and v as one GEMM weight ``[d, 2·H·D + 2·Hkv·D]``."""
        return packing.gemm_weight(self, self.q_proj.weight, self.k_proj.weight,
                                     self.v_proj.weight)

    def native_part(self) -> AttentionPart:
        """The layer as the native step takes it: the gate interleaved per head in qkv, q / k
        normed per head, rotary on the first ``rotary_dim``."""
        cfg = self.cfg
        return AttentionPart(self.qkv_weight(), norm_weight(self.q_norm),
                             norm_weight(self.k_norm), packing.packed(self.o_proj),
                             inv_freq(cfg), torch.empty(0), cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, False, 0, True, 1.0, 1.0,
                             float(cfg.rms_norm_eps))

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, d]`` -> q ``[B, H, T, D]``, k, v ``[B, Hkv, T, D]`` (fp32, rotated) and
        the output gate ``[B, T, H·D]``."""
        b, t, _ = x.shape
        cfg = self.cfg
        d, kv_width = cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        qg, k, v = invariant.project(x, self.qkv_weight()).to(x.dtype).float().split(
            [2 * cfg.num_attention_heads * d, kv_width, kv_width], dim=-1)
        q, gate = qg.reshape(b, t, -1, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.reshape(b, t, -1, d)).transpose(1, 2)
        v = v.reshape(b, t, -1, d).transpose(1, 2)
        return rope(q, pos, self.cfg), rope(k, pos, self.cfg), v, gate.reshape(b, t, -1)

    def _out(self, o: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, H, T, D]`` -> gated, projected ``[B, T, d]``."""
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, -1) * invariant.rowwise(torch.sigmoid, gate)
        return self.o_proj(o.to(x.dtype))

    def forward(self, x: torch.Tensor, kv: KVEntry, start: int,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[B, T, d]`` at cache slots start … start+T−1 (every row alike),
        their rotary positions the slots' own or ``positions`` ``[3, B, T]`` (:mod:`.mrope`)."""
        return self._attend(x, kv, slice(None), start, positions)

    def _attend(self, x: torch.Tensor, kv: KVEntry, rows: slice, start: int,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens ``[b, T, d]`` of cache rows ``rows`` at slots start … start+T−1."""
        t = x.shape[1]
        pos = torch.arange(start, start + t)[None] if positions is None else positions
        q, k, v, gate = self._qkv(x, pos)
        kv.put(rows, slice(start, start + t), k, v)
        o = invariant.attention(q, kv.keys(rows, start + t), kv.values(rows, start + t), start)
        return self._out(o, gate, x)

    def forward_ragged(self, x: torch.Tensor, kv: KVEntry, starts: torch.Tensor,
                       new: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """A right-padded ragged batch ``[B, T, d]``: row i's ``new[i]`` real tokens at
        slots ``starts[i]`` on, their positions ``offsets[i]`` past them (each row attends
        alone; padding gives zeros)."""
        out = torch.zeros_like(x)
        for i, (start, n) in enumerate(zip(starts.tolist(), new.tolist(), strict=True)):
            pos = None if offsets is None else \
                torch.arange(start, start + n)[None] + offsets[i]
            out[i : i + 1, :n] = self._attend(x[i : i + 1, :n], kv, slice(i, i + 1), start,
                                              pos)
        return out

    def step(self, x: torch.Tensor, kv: KVEntry, lengths: torch.Tensor,
             offsets: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row ``[B, d]`` at each row's own slot ``lengths [B]``, its rotary
        position ``offsets [B]`` past it."""
        b = x.shape[0]
        pos = lengths if offsets is None else lengths + offsets
        q, k, v, gate = self._qkv(x.unsqueeze(1), pos[:, None])
        rows = torch.arange(b)
        kv.put(rows, lengths, k[:, :, 0], v[:, :, 0])
        outs = []
        for i, n in enumerate((lengths + 1).tolist()):  # each row over its own keys alone
            one = slice(i, i + 1)
            outs.append(invariant.attention(q[i : i + 1], kv.keys(one, n), kv.values(one, n),
                                            n - 1))
        return self._out(torch.cat(outs), gate, x.unsqueeze(1)).squeeze(1)


def norm_weight(n: nn.Module) -> torch.Tensor:
    """A Qwen RMSNorm's weight as the native step takes it: 1 + w, fp32."""
    return cast(RMSNorm, n).scale().detach().contiguous()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.delta)
        else:
            self.self_attn = GatedAttention(cfg)
        moe = cfg.experts
        self.mlp: nn.Module
        if moe is not None and moe.sparse[index]:
            self.mlp = SparseMoE(cfg.hidden_size, moe.expert_size, moe.router,
                                 shared=moe.shared_size, shared_gate=True)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = qwen_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = qwen_norm(cfg.hidden_size, cfg.rms_norm_eps)

    def native_parts(self) -> tuple[LayerPart, LayerPart]:
        """The mixer and the MLP as the native step composes them: pre-norm residuals."""
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        return (LayerPart(mixer, self.input_layernorm),
                LayerPart(self.mlp, self.post_attention_layernorm))

    def _mix(self, h: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
             one_token: bool, new: torch.Tensor | None, positions: torch.Tensor | None
             ) -> torch.Tensor:
        if self.kind == "linear_attention":
            if one_token:
                return self.linear_attn.step(h, entries["recurrent"], entries["conv"])
            return self.linear_attn(h, entries["recurrent"], entries["conv"], new)
        held = entries.get("position")
        offsets = held.offset if isinstance(held, PositionEntry) else None
        if one_token:
            return self.self_attn.step(h, entries["kv"], lengths, offsets)
        if new is not None:
            return self.self_attn.forward_ragged(h, entries["kv"], lengths, new, offsets)
        return self.self_attn(h, entries["kv"], int(lengths[0]), positions)

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``lengths [B]``: each row's tokens so far; ``new [B]``: a ragged prefill's real
        token counts (None: all of x's T, or one token with ``one_token``); ``positions``
        ``[3, B, T]``: a prefill's rotary positions where they are not the slots' (:mod:`.mrope`;
        a step's and a ragged prefill's come from the entries' ``position`` offsets)."""
        x = x + self._mix(self.input_layernorm(x), entries, lengths, one_token, new,
                          positions)
        return x + self.mlp(self.post_attention_layernorm(x))
