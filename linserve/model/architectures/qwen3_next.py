"""Qwen3-Next (``qwen3_next``, ``Qwen3NextForCausalLM``): Qwen3.5's layers
(:mod:`linserve.model.architectures.qwen3_5`: Gated DeltaNet, gated attention, Qwen's RMSNorm) with
sparse experts on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` choose, and a
dense MLP on the others.

Its checkpoints store the Gated DeltaNet's input projections interleaved by key head:
``in_proj_qkvz`` holds, for each key head in turn, its q and k rows, then the v and z rows
of the value heads it serves; ``in_proj_ba`` the same for b and a. They are split at load
time into Qwen3.5's ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b`` and
``in_proj_a``, so one module serves both. Experts come one by one
(``mlp.experts.{e}.gate_proj``) or stacked.
"""

from __future__ import annotations

import re

import torch

from linserve.model.architectures import hf
from linserve.model.architectures.family import HFFamily
from linserve.model.architectures.qwen3_5 import Qwen35Config, Qwen35ForCausalLM
from linserve.model.architectures.qwen3_5.model import describe_as, mtp_present, rename
from linserve.model.layers.moe import split_stacked

_GDN = re.compile(r"^(.*\.linear_attn)\.in_proj_(qkvz|ba)\.weight$")


def split_for(cfg: Qwen35Config) -> hf.Split:
    """The rows of Qwen3.5's projections in Qwen3-Next's interleaved ones (and the stacked
    experts, as everywhere)."""
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r = cfg.linear_num_value_heads // nk
    dv = cfg.linear_value_head_dim

    def rows(width: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of every key head's group of ``width`` rows, group after
        group."""
        return (torch.arange(nk)[:, None] * width + torch.arange(start, stop)).flatten()

    qkvz = 2 * dk + 2 * r * dv
    parts = {
        "qkvz": [("in_proj_qkv", torch.cat([rows(qkvz, 0, dk), rows(qkvz, dk, 2 * dk),
                                            rows(qkvz, 2 * dk, 2 * dk + r * dv)])),
                 ("in_proj_z", rows(qkvz, 2 * dk + r * dv, qkvz))],
        "ba": [("in_proj_b", rows(2 * r, 0, r)), ("in_proj_a", rows(2 * r, r, 2 * r))],
    }

    def split(name: str, shape: tuple[int, ...]
              ) -> list[tuple[str, hf.Index]] | None:
        hit = _GDN.match(name)
        if hit is None:
            return split_stacked(name, shape)
        prefix, kind = hit.groups()
        return [(f"{prefix}.{target}.weight", (index,)) for target, index in parts[kind]]

    return split


FAMILY = HFFamily(Qwen35Config.from_hf, Qwen35ForCausalLM, rename, describe_as("qwen3_next"),
                  split_for=split_for, config_for=mtp_present)
