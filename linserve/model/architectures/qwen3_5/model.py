"""Qwen3.5's dense and MoE text models: Gated DeltaNet layers interleaved with gated full
attention (:mod:`.layers`), one native call a step, the checkpoint's MTP layers as a draft
head (:mod:`.mtp`), and the families' loader (``FAMILY``, an ``HFFamily``).

Layer types come from the checkpoint's ``layer_types`` (three ``linear_attention`` to one
``full_attention`` in the published models). Module and parameter names follow Hugging Face's
``Qwen3_5ForCausalLM``, so its ``model.safetensors`` loads as it is (see
:mod:`linserve.model.architectures.hf`). Shapes: B rows, T tokens, d = hidden_size.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from linserve.model import kernels, packing
from linserve.model.architectures import hf
from linserve.model.architectures.family import HFFamily
from linserve.model.architectures.qwen3_5.layers import (
    EMPTY,
    DecoderLayer,
    Qwen35Config,
    layer_weights,
    native_mlp,
    norm_weight,
    qwen_norm,
    step_tensors,
)
from linserve.model.architectures.qwen3_5.mtp import NativeArgs, QwenMTP, native_args
from linserve.model.layers.decoder import DecoderLM
from linserve.model.state import ConvEntry, KVEntry, RecurrentEntry, State
from linserve.model.verify import Trail, verify_by_steps

log = logging.getLogger("linserve")


@dataclass
class FusedArgs:
    """The native step's arguments that do not change from step to step."""

    weights: list[torch.Tensor]
    experts: list[torch.Tensor]
    ints: list[int]


class Qwen35ForCausalLM(DecoderLM):
    """The whole text model on the shared decoder body (:class:`DecoderLM`: embeddings,
    prefill whole, chunked and ragged, the head), with its own layers and state, and a step
    that is one native call for the whole model where the kernels are built
    (:meth:`step_eager`, layer by layer, elsewhere). Logits fp32."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__(cfg, cfg.vocab_size, cfg.hidden_size,
                         [DecoderLayer(cfg, kind, i) for i, kind in enumerate(cfg.layer_types)],
                         qwen_norm(cfg.hidden_size, cfg.rms_norm_eps), cfg.tie_word_embeddings)
        self._fused: tuple[Any, FusedArgs | None] | None = None
        self.mtp = QwenMTP(cfg) if cfg.mtp_layers else None

    def draft_head(self) -> MtpHead | None:
        """The checkpoint's MTP layers as a draft head (None: it has none)."""
        return MtpHead(self) if self.mtp is not None else None

    @property
    def fused(self) -> bool:
        """Whether the whole-model native step serves this shape (with or without experts)."""
        return all(native_mlp(cast(DecoderLayer, layer)) for layer in self.model.layers)

    def pack_layer(self, i: int) -> None:
        """Build layer ``i``'s packed weights as the native step reads them."""
        if not self.fused:
            super().pack_layer(i)
            return
        layer_weights(cast(DecoderLayer, self.model.layers[i]), self.cfg, [])

    def new_state(self, batch: int = 1, max_context: int | None = None) -> State:
        cfg = self.cfg
        layers: list[dict[str, Any]] = []
        for kind in cfg.layer_types:
            if kind == "linear_attention":
                layers.append({
                    "recurrent": RecurrentEntry.empty(batch, cfg.linear_num_value_heads,
                                                      cfg.linear_key_head_dim,
                                                      cfg.linear_value_head_dim, with_z=False),
                    "conv": ConvEntry.empty(batch, cfg.linear_conv_kernel_dim, cfg.delta.conv_dim)})
            else:
                layers.append({"kv": KVEntry.empty(batch, cfg.num_key_value_heads, cfg.head_dim,
                                                   max_context or cfg.max_position_embeddings)})
        return State(layers, torch.zeros(batch, dtype=torch.long))

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """tokens ``[B]`` -> logits ``[B, V]``; advances every row of ``state`` in place.
        One native call for the whole model (``linserve/model/kernels/qwen35_step.cpp``) where the
        kernels are built, else :meth:`step_eager`."""
        state.reserve(int(state.lengths.max()) + 1)
        tensors = [t for entries in state.layers for t in step_tensors(entries)]
        args = self.fused_args() if kernels.available() else None
        if args is not None and all(t.is_contiguous() for t in tensors):
            logits = torch.ops.linserve.qwen35_step(
                tokens.contiguous(), args.weights, args.experts, tensors, state.lengths,
                args.ints, self.dims(), self.cfg.rms_norm_eps)
            state.lengths += 1
            return logits
        return self.step_eager(tokens, state)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, Trail]:
        """tokens ``[B, T]`` -> logits ``[B, T, V]``, the state advanced by all T and the
        trail to land on any of them (:mod:`linserve.model.verify`): one native call
        (``qwen35_verify``) where the step is native, else step by step."""
        b, t = tokens.shape
        state.reserve(int(state.lengths.max()) + t)
        tensors = [x for entries in state.layers for x in step_tensors(entries)]
        args = self.fused_args() if kernels.available() else None
        if args is None or not all(x.is_contiguous() for x in tensors):
            return verify_by_steps(self.step, tokens, state)
        kinds = args.ints[::5]
        snaps = [torch.empty(t - 1, *x.shape) if kinds[i // 2] == 0 and t > 1 else EMPTY
                 for i, x in enumerate(tensors)]
        hidden = torch.empty(t * b, self.cfg.hidden_size)
        logits = torch.ops.linserve.qwen35_verify(
            tokens.t().contiguous().flatten(), args.weights, args.experts, tensors, snaps,
            hidden, state.lengths, args.ints, self.dims(), self.cfg.rms_norm_eps, t)
        state.lengths += t
        kept = [x for x in snaps if x.numel()]
        trail = Trail([[x[i] for x in kept] for i in range(t - 1)],
                      hidden.view(t, b, -1).transpose(0, 1))
        return logits.view(t, b, -1).transpose(0, 1), trail

    def dims(self) -> list[int]:
        cfg = self.cfg
        return [cfg.hidden_size, cfg.num_attention_heads,
                cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
                cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim]

    def fused_weights(self) -> list[torch.Tensor]:
        """The native step's weight list (its order: ``qwen35_step.cpp``'s header)."""
        args = self.fused_args()
        return [] if args is None else args.weights

    def fused_args(self) -> FusedArgs | None:
        """The native step's weights, experts and ints (None: a layer it does not take).
        GEMM weights are the very tensors the eager forms use (:func:`packing.gemm_weight`),
        so nothing is stored twice; rebuilt when the mode flips or the weights are replaced."""
        key = self.weights_key()
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, self._pack_fused())
        return self._fused[1]

    def _pack_fused(self) -> FusedArgs | None:
        emb = self.model.embed_tokens
        head = packing.gemm_weight(emb, emb.weight) if self.lm_head is None \
            else packing.packed(self.lm_head)
        out = FusedArgs([packing.embedding_table(emb), head, norm_weight(self.model.norm)],
                        [], [])
        for layer in self.model.layers:
            found = layer_weights(cast(DecoderLayer, layer), self.cfg, out.experts)
            if found is None:
                return None
            out.weights += found[0]
            out.ints += found[1]
        return out

    def prepare(self, fused: bool) -> bool:
        """After the load: the MTP head's weights packed as the layers' are, then the whole
        native step's (or every layer's packed weights where the step is not native);
        whether a step is one native call (the step is native for every shape it takes,
        whatever ``fused`` asks)."""
        del fused
        head = self.draft_head()
        if head is not None:
            head.logits(head.extend(head.new_state(), torch.zeros(2, self.cfg.hidden_size),
                                    [0, 0]))
        if self.fused:
            self.fused_weights()
        else:
            self.pack_weights()
        return self.fused and kernels.available()

    def drop_weights(self) -> None:
        """Free every weight (states can still be built; the model cannot run)."""
        self._fused = None
        packing.strip(self)


# ---- loading a Hugging Face checkpoint ------------------------------------------------------

def rename(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`Qwen35ForCausalLM` (None: not the text model)."""
    if name.startswith("model.language_model."):  # Qwen3_5ForConditionalGeneration
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return None
    return name


def mtp_present(cfg: Qwen35Config, path: Path) -> Qwen35Config:
    """The config with MTP layers only where the checkpoint has their tensors (a checkpoint
    saved by transformers keeps ``mtp_num_hidden_layers`` but drops ``mtp.*``)."""
    if cfg.mtp_layers and not hf.is_gguf(path) and \
            not any(n.startswith("mtp.") for n in hf.tensor_files(path)):
        return dataclasses.replace(cfg, mtp_layers=0)
    return cfg


def describe_as(name: str, moe_name: str = "") -> Callable[[Qwen35Config], str]:
    """The architecture line of a checkpoint served under ``name`` (``moe_name`` where it
    has experts and its name differs)."""

    def describe(cfg: Qwen35Config) -> str:
        attn = sum(t == "full_attention" for t in cfg.layer_types)
        arch = f"{moe_name if cfg.experts is not None and moe_name else name} "
        arch += f"(Gated DeltaNet + gated attention, {attn} of "
        arch += f"{len(cfg.layer_types)} layers full attention"
        if cfg.experts is not None:
            r = cfg.experts.router
            arch += f"; {r.experts} experts, top {r.top_k} + a shared expert"
        if cfg.mtp_layers:
            arch += f"; {cfg.mtp_layers} MTP layer{'s' if cfg.mtp_layers > 1 else ''}"
        return arch + ")"

    return describe


FAMILY = HFFamily(Qwen35Config.from_hf, Qwen35ForCausalLM, rename,
                  describe_as("qwen3_5", "qwen3_5_moe"), config_for=mtp_present)


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
        key = self.model.weights_key()
        if self._native is None or self._native[0] != key:
            args = self.model.fused_args() if kernels.available() else None
            found = None if args is None else native_args(self.mtp, args.weights[0],
                                                          args.weights[1])
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
