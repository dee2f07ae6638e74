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
layers drafts with its first). It runs in one native call (``qwen35_mtp``, the native step's
own attention and MLP) where the kernels are built, else layer by layer in PyTorch, the
reference. Shapes: n positions, d hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from linserve.model import invariant, kernels
from linserve.model.invariant import Linear
from linserve.model.state import KVEntry, State

if TYPE_CHECKING:
    from linserve.model.architectures.qwen3_5 import Qwen35Config, Qwen35ForCausalLM


@dataclass
class NativeArgs:
    """``qwen35_mtp``'s arguments that do not change from call to call."""

    weights: list[torch.Tensor]
    experts: list[torch.Tensor]
    ints: list[int]


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
        return State([{"kv": KVEntry.empty(1, cfg.num_key_value_heads, cfg.head_dim, ctx)}],
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


class MtpHead:
    """The served model's MTP layers as a draft head (``ServedModel.draft_head``): per request
    a state, extended position by position, and logits through the model's head."""

    def __init__(self, model: Qwen35ForCausalLM) -> None:
        assert model.mtp is not None
        self.model, self.mtp = model, model.mtp
        self._native: tuple[Any, NativeArgs | None] | None = None

    def native_args(self) -> NativeArgs | None:
        """``qwen35_mtp``'s weights, experts and ints (None: no kernels, or a layer the
        native step does not take); rebuilt when the weights are replaced."""
        from linserve.model.architectures.qwen3_5 import DecoderLayer, _layer_weights, _norm
        key = self.model.weights_key()
        if self._native is None or self._native[0] != key:
            found, args = None, self.model.fused_args() if kernels.available() else None
            experts: list[torch.Tensor] = []
            layer = cast(DecoderLayer, self.mtp.layers[0])
            described = None if args is None else _layer_weights(layer, self.mtp.cfg, experts)
            if args is not None and described is not None:
                mtp = self.mtp
                weights = [args.weights[0], args.weights[1], _norm(mtp.pre_fc_norm_embedding),
                           _norm(mtp.pre_fc_norm_hidden), invariant.packed(mtp.fc),
                           _norm(mtp.norm), *described[0]]
                found = NativeArgs(weights, experts, described[1])
            self._native = (key, found)
        return self._native[1]

    def new_state(self) -> State:
        return self.mtp.new_state()

    @torch.inference_mode()
    def extend(self, state: State, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """``hidden [n, d]`` (the final norm's output at n positions, or the head's own g)
        and the token after each -> g ``[n, d]`` fp32; ``state`` advanced by n."""
        args = self.native_args()
        kv = cast(KVEntry, state.layers[0]["kv"])
        state.reserve(int(state.lengths[0]) + len(tokens))
        if args is not None and kv.k.is_contiguous() and kv.v.is_contiguous():
            cfg = self.model.cfg
            g: torch.Tensor = torch.ops.linserve.qwen35_mtp(
                torch.tensor(tokens), hidden.float().contiguous(), args.weights, args.experts,
                [kv.k, kv.v], state.lengths, args.ints, self.model.dims(), cfg.rms_norm_eps)
            state.lengths += len(tokens)
            return g
        return self.extend_eager(state, hidden, tokens)

    @torch.inference_mode()
    def extend_eager(self, state: State, hidden: torch.Tensor, tokens: list[int]
                     ) -> torch.Tensor:
        """:meth:`extend` layer by layer in PyTorch (the native call's reference)."""
        dtype = self.model.model.embed_tokens.weight.dtype
        embeds = self.model.embed(torch.tensor([tokens])).to(dtype)
        return self.mtp(embeds, hidden.to(dtype)[None], state)[0].float()

    @torch.inference_mode()
    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g ``[n, d]`` -> the logits ``[n, V]`` of the token after the next, through the
        served model's head."""
        dtype = self.model.model.embed_tokens.weight.dtype
        return self.model.logits(g.to(dtype))
