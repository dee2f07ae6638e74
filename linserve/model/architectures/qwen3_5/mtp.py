"""Qwen3.5's multi-token-prediction (MTP) layers: the checkpoint's own draft head.

Qwen3.5 and Qwen3-Next checkpoints carry ``mtp.*`` tensors (``mtp_num_hidden_layers``, or
``num_nextn_predict_layers``; vLLM's ``qwen3_5_mtp.py`` and llama.cpp's ``_QwenMtpMixin``
read the same): at position p, from the served model's final-norm output h_p and the next
token x_{p+1},

    g_p = norm(layer(fc([norm_e(embed(x_{p+1})), norm_h(h_p)])))

and head(g_p) predicts x_{p+2}, through the served model's own embedding table and head.
The layer is a full-attention Qwen3.5 decoder layer with a KV cache of its own (RoPE at
positions counted in that cache); a further draft feeds g_p back as the hidden state with the
token just drafted (one layer reused, as vLLM does for k > 1; a checkpoint with several MTP
layers drafts with its first). It runs in one native call (``decoder_mtp``: a plan of the
whole-model native step with an MTP prologue) where the kernels are built, else layer by
layer in PyTorch, the reference. The draft head over them is the model's
(``model.MtpHead``). Shapes: n positions, d hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from linserve.model import packing
from linserve.model.architectures.qwen3_5.layers import (
    DecoderLayer,
    Qwen35Config,
    norm_weight,
    qwen_norm,
)
from linserve.model.invariant import Linear
from linserve.model.layers import native_step
from linserve.model.layers.step_parts import MtpPrologue
from linserve.model.state import KVEntry, State


class QwenMTP(nn.Module):
    """``mtp.*`` of a checkpoint (see the module docstring)."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.fc = Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = qwen_norm(d, eps)
        self.pre_fc_norm_hidden = qwen_norm(d, eps)
        last = len(cfg.layer_types) - 1  # sparse or dense as the last layer is
        self.layers = nn.ModuleList(DecoderLayer(cfg, "full_attention", last)
                                    for _ in range(cfg.mtp_layers))
        self.norm = qwen_norm(d, eps)

    def new_state(self, max_context: int | None = None) -> State:
        """One request's MTP KV caches (one row)."""
        cfg = self.cfg
        ctx = max_context or cfg.max_position_embeddings
        # fp32 whatever --kv-cache-dtype: the draft's own short cache, run by decoder_mtp
        return State([{"kv": KVEntry.empty(1, cfg.num_key_value_heads, cfg.head_dim, ctx,
                                           dtype="fp32")}],
                     torch.zeros(1, dtype=torch.long))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, state: State) -> torch.Tensor:
        """``embeds``, ``hidden`` ``[1, n, d]`` after ``state`` (advanced in place) ->
        g ``[1, n, d]``, the MTP norm's output."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], -1))
        n = x.shape[1]
        state.reserve(int(state.lengths[0]) + n)
        x = self.layers[0](x, state.layers[0], state.lengths)
        state.lengths += n
        return self.norm(x)




def mtp_plan(mtp: QwenMTP, table: torch.Tensor, head: torch.Tensor) -> native_step.Plan | None:
    """``mtp``'s first layer as a native plan (``decoder_mtp``) beside the served model's
    embedding ``table`` and ``head``; None: a layer the native step does not take."""
    eps = float(mtp.cfg.rms_norm_eps)
    prologue = MtpPrologue(norm_weight(mtp.pre_fc_norm_embedding),
                           norm_weight(mtp.pre_fc_norm_hidden), packing.packed(mtp.fc), eps)
    return native_step.build([table, head, norm_weight(mtp.norm), torch.empty(0)],
                             [eps, 1.0, 1.0, 0.0],
                             list(mtp.layers[:1]), prologue)
