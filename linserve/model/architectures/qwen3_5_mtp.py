"""Qwen3.5's multi-token-prediction (MTP) layers: the checkpoint's own draft head.

Qwen3.5 and Qwen3-Next checkpoints carry ``mtp.*`` tensors (``mtp_num_hidden_layers``, or
``num_nextn_predict_layers``; vLLM's ``qwen3_5_mtp.py`` and llama.cpp's ``_QwenMtpMixin``
read the same): at position p, from the served model's final-norm output h_p and the next
token x_{p+1},

    g_p = norm(layer(fc([norm_e(embed(x_{p+1})), norm_h(h_p)])))

and head(g_p) predicts x_{p+2}, through the served model's own embedding table and head.
The layer is a full-attention Qwen3.5 decoder layer with a KV cache of its own (RoPE at
positions counted in that cache); a further draft feeds g_p back as the hidden state with the
token just drafted (one layer reused, as vLLM does for k > 1). Shapes: n positions, d hidden.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from linserve.model.invariant import Linear
from linserve.model.state import KVEntry, State

if TYPE_CHECKING:
    from linserve.model.architectures.qwen3_5 import Qwen35Config, Qwen35ForCausalLM


class QwenMTP(nn.Module):
    """``mtp.*`` of a checkpoint (see the module docstring)."""

    def __init__(self, cfg: Qwen35Config) -> None:
        from linserve.model.architectures.qwen3_5 import DecoderLayer, qwen_norm
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
        return State([{"kv": KVEntry.empty(1, cfg.num_key_value_heads, cfg.head_dim, ctx)}
                      for _ in self.layers], torch.zeros(1, dtype=torch.long))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, state: State) -> torch.Tensor:
        """``embeds``, ``hidden`` ``[1, n, d]`` after ``state`` (advanced in place) ->
        g ``[1, n, d]``, the MTP norm's output."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], -1))
        n = x.shape[1]
        state.reserve(int(state.lengths[0]) + n)
        for layer, entries in zip(self.layers, state.layers, strict=True):
            x = layer(x, entries, state.lengths)
        state.lengths += n
        return self.norm(x)


class MtpHead:
    """The served model's MTP layers as a draft head (``ServedModel.draft_head``): per request
    a state, extended position by position, and logits through the model's head."""

    def __init__(self, model: Qwen35ForCausalLM) -> None:
        assert model.mtp is not None
        self.model, self.mtp = model, model.mtp

    def new_state(self) -> State:
        return self.mtp.new_state()

    @torch.inference_mode()
    def extend(self, state: State, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """``hidden [n, d]`` (the final norm's output at n positions, or the head's own g)
        and the token after each -> g ``[n, d]`` fp32; ``state`` advanced by n."""
        dtype = self.model.model.embed_tokens.weight.dtype
        embeds = self.model.embed(torch.tensor([tokens])).to(dtype)
        return self.mtp(embeds, hidden.to(dtype)[None], state)[0].float()

    @torch.inference_mode()
    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g ``[n, d]`` -> the logits ``[n, V]`` of the token after the next, through the
        served model's head."""
        dtype = self.model.model.embed_tokens.weight.dtype
        return self.model.logits(g.to(dtype))
