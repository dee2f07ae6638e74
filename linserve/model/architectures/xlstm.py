"""xLSTM (``xlstm``: transformers' ``xLSTMForCausalLM``, NX-AI's xLSTM-7B): per block an
RMSNorm, the mLSTM layer (:mod:`linserve.model.layers.mlstm`), an RMSNorm and a SwiGLU feed-
forward; an RMSNorm and the head, whose logits are soft-capped (``output_logit_soft_cap``).
State per layer: the mLSTM's C, n and m per head, constant in size. Both of transformers'
weight modes load: ``single`` as it is, ``fused`` split into the same projections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linserve.model.architectures.family import DecoderConfig, HFFamily, renamer
from linserve.model.architectures.hf import Index
from linserve.model.layers.block import Block
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.mlstm import MlstmLayer, MlstmShape
from linserve.model.layers.norms import RMSNorm


def round_up(x: float, multiple: int) -> int:
    return int(((x + multiple - 1) // multiple) * multiple)


@dataclass(frozen=True, kw_only=True)
class XlstmConfig(DecoderConfig):
    num_hidden_layers: int
    num_heads: int
    qk_dim: int
    v_dim: int
    ffn_dim: int
    norm_eps: float
    eps: float
    gate_soft_cap: float
    output_logit_soft_cap: float | None
    fused: bool

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> XlstmConfig:
        d = int(c.get("hidden_size") or c["embedding_dim"])
        if c.get("use_bias"):
            raise NotImplementedError("xLSTM with biases (use_bias) is not served")
        if not c.get("add_out_norm", True):
            raise NotImplementedError("xLSTM without its output norm is not served")
        mode = c.get("weight_mode", "single")
        if mode not in ("single", "fused"):
            raise ValueError(f"weight_mode {mode!r} is neither single nor fused")
        heads = int(c["num_heads"])
        qk, v = int(d * float(c.get("qk_dim_factor", 0.5))), int(d * float(c.get("v_dim_factor",
                                                                                  1.0)))
        if qk % heads or v % heads:
            raise ValueError(f"qk_dim {qk} and v_dim {v} must split into num_heads {heads}")
        cap = c.get("output_logit_soft_cap", 30.0)
        # transformers never ties xLSTM's head to its embeddings, whatever the config says
        return cls(**DecoderConfig.shared({**c, "hidden_size": d, "tie_word_embeddings": False},
                                          1_048_576, False),
                   num_hidden_layers=int(c.get("num_hidden_layers") or c["num_blocks"]),
                   num_heads=heads, qk_dim=qk, v_dim=v,
                   ffn_dim=round_up(d * float(c.get("ffn_proj_factor", 2.667)),
                                    int(c.get("ffn_round_up_to_multiple_of", 64))),
                   norm_eps=float(c.get("norm_eps", 1e-6)), eps=float(c.get("eps", 1e-6)),
                   gate_soft_cap=float(c.get("gate_soft_cap", 15.0)),
                   output_logit_soft_cap=None if cap is None else float(cap),
                   fused=mode == "fused")

    @property
    def shape(self) -> MlstmShape:
        return MlstmShape(self.hidden_size, self.num_heads, self.qk_dim, self.v_dim,
                          self.gate_soft_cap, self.norm_eps, self.eps)


class XlstmLM(DecoderLM):
    """The whole model on the shared decoder body."""

    def __init__(self, cfg: XlstmConfig) -> None:
        d, eps = cfg.hidden_size, cfg.norm_eps
        layers = [Block(MlstmLayer(cfg.shape), SwiGLU(d, cfg.ffn_dim, fused=cfg.fused), RMSNorm,
                        d, eps) for _ in range(cfg.num_hidden_layers)]
        super().__init__(cfg, cfg.vocab_size, d, layers, RMSNorm(d, eps),
                         cfg.tie_word_embeddings, logits_soft_cap=cfg.output_logit_soft_cap)


_B, _TO = r"^backbone\.blocks\.(\d+)\.", r"model.layers.\1."
rename = renamer([
    (_B + r"norm_mlstm\.", _TO + "input_layernorm."),
    (_B + r"norm_ffn\.", _TO + "post_attention_layernorm."),
    (_B + r"mlstm_layer\.", _TO + "mixer."),
    (_B + r"ffn\.proj_up_gate_z\.", _TO + "mlp.gate_up_proj."),
    (_B + r"ffn\.proj_up_gate\.", _TO + "mlp.gate_proj."),
    (_B + r"ffn\.proj_up\.", _TO + "mlp.up_proj."),
    (_B + r"ffn\.proj_down\.", _TO + "mlp.down_proj."),
    (r"^backbone\.embeddings\.", "model.embed_tokens."),
    (r"^backbone\.out_norm\.", "model.norm."),
])


def splits(cfg: XlstmConfig) -> Any:
    """The ``fused`` mode's projections: q, k, v and o stacked by rows in ``qkv_opreact``,
    the two gates (weight and bias) in ``ifgate_preact``."""
    qk, v, h = cfg.qk_dim, cfg.v_dim, cfg.num_heads
    qkvo = (("q", 0, qk), ("k", qk, 2 * qk), ("v", 2 * qk, 2 * qk + v),
            ("ogate_preact", 2 * qk + v, 2 * qk + 2 * v))
    gates = (("igate_preact", 0, h), ("fgate_preact", h, 2 * h))

    def split(name: str, shape: tuple[int, ...]) -> list[tuple[str, Index]] | None:
        del shape
        for fused, parts in ((".mixer.qkv_opreact.", qkvo), (".mixer.ifgate_preact.", gates)):
            if fused in name:
                prefix, leaf = name.split(fused)
                return [(f"{prefix}.mixer.{p}.{leaf}", (slice(a, b),)) for p, a, b in parts]
        return None

    return split


def describe(cfg: XlstmConfig) -> str:
    return (f"xlstm (xLSTM, {cfg.num_hidden_layers} mLSTM blocks, {cfg.num_heads} heads, "
            f"{cfg.hidden_size} wide)")


FAMILY = HFFamily(XlstmConfig.from_hf, XlstmLM, rename, describe, split_for=splits)
