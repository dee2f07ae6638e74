"""Falcon-H1 (``falcon_h1``, ``FalconH1ForCausalLM``): every layer runs Mamba2
(:mod:`linserve.model.layers.mamba2`) and grouped-query attention *in parallel* on the same normed
input and adds both, then a SwiGLU MLP. Its µP multipliers: ``embedding_multiplier``,
``lm_head_multiplier``, ``attention_in_multiplier`` / ``attention_out_multiplier``,
``key_multiplier``, ``ssm_in_multiplier`` / ``ssm_out_multiplier``, ``ssm_multipliers``
(z, x, B, C, dt of the Mamba2 projection), ``mlp_multipliers``; ``mamba_d_ssm`` sets the
Mamba2 width and ``mamba_rms_norm`` its gated norm (else y · silu(z)). State per layer: the
SSM state and conv window (constant) and a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.layers.attention import Attention, AttentionShape
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mamba2 import Mamba2, Mamba2Shape
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.norms import RMSNorm


@dataclass(frozen=True, kw_only=True)
class FalconH1Config(DecoderConfig):
    num_hidden_layers: int
    intermediate_size: int
    attention: AttentionShape
    mamba: Mamba2Shape
    eps: float
    multipliers: dict[str, Any]

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> FalconH1Config:
        d = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or d // heads)
        eps = float(c.get("rms_norm_eps", 1e-5))
        ssm = [float(m) for m in c.get("ssm_multipliers") or [1.0] * 5]
        mult: dict[str, Any] = {k: float(c.get(k, 1.0)) for k in (
            "embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier",
            "attention_out_multiplier", "ssm_out_multiplier")}
        mult["mlp"] = tuple(float(m) for m in c.get("mlp_multipliers") or [1.0, 1.0])
        return cls(
            **DecoderConfig.shared(c, 8192, False),
            num_hidden_layers=int(c["num_hidden_layers"]),
            intermediate_size=int(c["intermediate_size"]),
            attention=AttentionShape.from_hf(
                c, theta=1e11, rotary_dim=head_dim,
                key_multiplier=float(c.get("key_multiplier", 1.0))),
            mamba=Mamba2Shape.from_hf(
                c, eps, norm_before_gate=bool(c.get("mamba_norm_before_gate", True)),
                gated_norm=bool(c.get("mamba_rms_norm", False)),
                in_multiplier=float(c.get("ssm_in_multiplier", 1.0)),
                proj_multipliers=(ssm[0], ssm[1], ssm[2], ssm[3], ssm[4])),
            eps=eps, multipliers=mult)


class ParallelBlock(nn.Module):
    """``x + a·mamba(n) + b·attention(c·n)`` with n = norm(x), then ``x + mlp(norm(x))``.
    Its state entries: the Mamba2's ``recurrent`` and ``conv`` and the attention's ``kv``."""

    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        d, m = cfg.hidden_size, cfg.multipliers
        self.input_layernorm = RMSNorm(d, cfg.eps)
        self.mamba = Mamba2(cfg.mamba)
        self.self_attn = Attention(cfg.attention)
        self.pre_ff_layernorm = RMSNorm(d, cfg.eps)
        self.feed_forward = SwiGLU(d, cfg.intermediate_size, multipliers=m["mlp"])
        self.attn_in, self.attn_out = m["attention_in_multiplier"], m["attention_out_multiplier"]
        self.ssm_out = m["ssm_out_multiplier"]

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        return {**self.mamba.new_entries(batch, max_context),
                **self.self_attn.new_entries(batch, max_context)}

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        a = h * self.attn_in
        if one_token:
            ssm, attn = (self.mamba.step(h, entries, lengths),
                         self.self_attn.step(a, entries, lengths))
        else:
            ssm, attn = (self.mamba(h, entries, lengths, new),
                         self.self_attn(a, entries, lengths, new))
        x = x + (ssm * self.ssm_out + attn * self.attn_out)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


def build(cfg: FalconH1Config) -> DecoderLM:
    d = cfg.hidden_size
    m = cfg.multipliers
    return DecoderLM(cfg, cfg.vocab_size, d,
                     [ParallelBlock(cfg) for _ in range(cfg.num_hidden_layers)],
                     RMSNorm(d, cfg.eps), cfg.tie_word_embeddings,
                     m["embedding_multiplier"], 1.0 / m["lm_head_multiplier"])


RENAMES = [(r"^model\.final_layernorm\.", "model.norm.")]


rename = renamer(RENAMES)


def describe(cfg: FalconH1Config) -> str:
    return f"falcon_h1 (Mamba2 and GQA attention in parallel, {cfg.num_hidden_layers} layers)"


FAMILY = HFFamily(FalconH1Config.from_hf, build, rename, describe)
