"""LFM2-MoE (``lfm2_moe``, ``Lfm2MoeForCausalLM``: LFM2-8B-A1B): LFM2's short convolutions
and attention layers (:mod:`linserve.model.architectures.lfm2`), with a SwiGLU MLP of
``intermediate_size`` on the first ``num_dense_layers`` layers and a sparse mixture of SwiGLU
experts (:mod:`linserve.model.layers.moe`) on the rest: sigmoid router, top ``num_experts_per_tok``
chosen by the scores plus ``expert_bias`` (``use_expert_bias``), their weights normalised
(``norm_topk_prob``) and scaled by ``routed_scaling_factor``. Checkpoints hold the experts
one by one (``feed_forward.experts.{e}.w1``) or stacked (``experts.gate_up_proj``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from linserve.model.architectures import lfm2
from linserve.model.architectures.family import HFFamily
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.mlp import SwiGLU
from linserve.model.layers.moe import RouterSpec, SparseMoE


@dataclass(frozen=True)
class Lfm2MoeConfig:
    base: lfm2.Lfm2Config  # its ff_size is the dense layers' intermediate_size
    dense_layers: int
    moe_size: int
    router: RouterSpec

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.base.max_position_embeddings

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Lfm2MoeConfig:
        base = dataclasses.replace(lfm2.Lfm2Config.from_hf(c),
                                   ff_size=int(c["intermediate_size"]))
        return cls(base, int(c.get("num_dense_layers", 2)), int(c["moe_intermediate_size"]),
                   RouterSpec(int(c["num_experts"]), int(c["num_experts_per_tok"]),
                              scoring="sigmoid", norm_topk=bool(c.get("norm_topk_prob", True)),
                              norm_eps=1e-6,
                              scaling=float(c.get("routed_scaling_factor") or 1.0),
                              expert_bias=bool(c.get("use_expert_bias", True))))


def build(cfg: Lfm2MoeConfig) -> DecoderLM:
    d = cfg.base.hidden_size
    mlps: list[nn.Module] = [
        SwiGLU(d, cfg.base.ff_size) if i < cfg.dense_layers
        else SparseMoE(d, cfg.moe_size, cfg.router)
        for i in range(len(cfg.base.layer_types))]
    return lfm2.build_with(cfg.base, cfg, mlps)


def describe(cfg: Lfm2MoeConfig) -> str:
    r = cfg.router
    return (f"lfm2_moe ({lfm2.describe(cfg.base).removeprefix('lfm2 (').rstrip(')')}; "
            f"{r.experts} experts, top {r.top_k}, {cfg.dense_layers} dense layers)")


FAMILY = HFFamily(Lfm2MoeConfig.from_hf, build, lfm2.rename,
                  describe)
