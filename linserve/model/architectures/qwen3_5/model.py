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
from pathlib import Path
from typing import Any, cast

import torch

from linserve.model import kernels, modes
from linserve.model.architectures import hf
from linserve.model.architectures.family import HFFamily
from linserve.model.architectures.qwen3_5 import mrope
from linserve.model.architectures.qwen3_5.layers import DecoderLayer, Qwen35Config, qwen_norm
from linserve.model.architectures.qwen3_5.mtp import QwenMTP, mtp_plan
from linserve.model.inputs import Encoder, InsertTable
from linserve.model.interface import CheckpointError
from linserve.model.layers import native_step
from linserve.model.layers.decoder import DecoderLM
from linserve.model.state import (
    ConvEntry,
    KVEntry,
    PositionEntry,
    RecurrentEntry,
    State,
    prefill_state,
)
from linserve.model.vision.qwen_prep import QwenImageSpec
from linserve.model.vision.qwen_tower import QwenImageEncoder, QwenVisionTower, VisionConfig

log = logging.getLogger("linserve")


class Qwen35ForCausalLM(DecoderLM):
    """The whole text model on the shared decoder body (:class:`DecoderLM`: embeddings,
    prefill whole, chunked and ragged, the head), with its own layers and state, and a step
    that is one native call for the whole model where the kernels are built
    (``decoder_step.cpp``; :meth:`step_eager`, layer by layer, elsewhere). Logits fp32."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__(cfg, cfg.vocab_size, cfg.hidden_size,
                         [DecoderLayer(cfg, kind, i) for i, kind in enumerate(cfg.layer_types)],
                         qwen_norm(cfg.hidden_size, cfg.rms_norm_eps), cfg.tie_word_embeddings)
        self.mtp = QwenMTP(cfg) if cfg.mtp_layers else None
        self.visual = QwenVisionTower(cfg.vision) if cfg.vision is not None else None
        self.kv_dtype = modes.kv_cache_dtype()  # what its caches hold, bound at the load

    def encoders(self) -> dict[str, Encoder]:
        """The image encoder where the vision tower is loaded."""
        if self.visual is None or self.cfg.image is None:
            return {}
        return {"image": QwenImageEncoder(self.visual, self.cfg.image)}

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, state: State | None = None,
                all_logits: bool = False, inserts: InsertTable | None = None,
                room: int = 0) -> tuple[torch.Tensor, State]:
        """:meth:`DecoderLM.prefill`, with (t, row, column) positions (:mod:`.mrope`) where
        the model reads images: an image's tokens at its grid's, and each row's offset kept
        in its state."""
        if self.visual is None:
            return super().prefill(tokens, state, all_logits, inserts, room)
        b, t = tokens.shape
        state = prefill_state(state, lambda: self.new_state(b), t, room)
        if bool((state.lengths != state.lengths[0]).any()):
            raise ValueError("prefill needs rows of equal length")
        held = [e for e in state.entries() if isinstance(e, PositionEntry)]
        pos, after = mrope.positions(tokens, state.lengths, held[0].offset, inserts)
        x = self._run(self.embed_prompt(tokens, inserts), state, positions=pos)
        for e in held:
            e.offset.copy_(after)
        state.lengths += t
        return self.head(x if all_logits else x[:, -1]), state

    def _run(self, x: torch.Tensor, state: State, one_token: bool = False,
             new: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        lengths = state.lengths if lengths is None else lengths
        for layer, entries in zip(self.model.layers, state.layers, strict=True):
            x = layer(x, entries, lengths, one_token=one_token, new=new, positions=positions)
        return x

    def draft_head(self) -> MtpHead | None:
        """The checkpoint's MTP layers as a draft head (None: it has none)."""
        return MtpHead(self) if self.mtp is not None else None

    @property
    def keeps_hidden(self) -> bool:
        """A verify keeps the final norm's outputs where the MTP head drafts from them."""
        return self.mtp is not None

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
                                                   max_context or cfg.max_position_embeddings,
                                                   dtype=self.kv_dtype)})
                if self.visual is not None:  # images move the positions after them
                    layers[-1]["position"] = PositionEntry.empty(batch)
        return State(layers, torch.zeros(batch, dtype=torch.long))

    def prepare(self, fused: bool) -> bool:
        """After the load: the MTP head's weights packed as the layers' are, then the
        decoder's (:meth:`DecoderLM.prepare`)."""
        head = self.draft_head()
        if head is not None:
            head.logits(head.extend(head.new_state(), torch.zeros(2, self.cfg.hidden_size),
                                    [0, 0]))
        if self.visual is not None:  # its weights packed too
            cfg = self.visual.cfg
            m = cfg.merge
            self.visual(torch.zeros(m * m, cfg.channels * cfg.temporal * cfg.patch ** 2), m, m)
        return super().prepare(fused)


# ---- loading a Hugging Face checkpoint ------------------------------------------------------

def rename(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`Qwen35ForCausalLM` (None: not the text model)."""
    if name.startswith("model.language_model."):  # Qwen3_5ForConditionalGeneration
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return None
    return name


def rename_for(cfg: Qwen35Config) -> Callable[[str], str | None]:
    """:func:`rename`, with the vision tower's tensors (``model.visual.*``) read where the
    config has one."""
    if cfg.vision is None:
        return rename

    def with_tower(name: str) -> str | None:
        if name.startswith("model.visual."):
            return "visual." + name.removeprefix("model.visual.")
        return rename(name)

    return with_tower


def mtp_present(cfg: Qwen35Config, path: Path) -> Qwen35Config:
    """The config with MTP layers only where the checkpoint has their tensors (a checkpoint
    saved by transformers keeps ``mtp_num_hidden_layers`` but drops ``mtp.*``), and the
    vision tower only where it has its tensors and images are wanted
    (:func:`linserve.model.modes.images_wanted`), its image spec from the folder's
    ``preprocessor_config.json``."""
    if cfg.mtp_layers and not hf.is_gguf(path) and \
            not any(n.startswith("mtp.") for n in hf.tensor_files(path)):
        cfg = dataclasses.replace(cfg, mtp_layers=0)
    if hf.is_gguf(path):
        proj = modes.mmproj()
        return cfg if proj is None else gguf_tower(cfg, path, proj)
    if cfg.vision is not None:
        tower = modes.images_wanted() and \
            any(n.startswith("model.visual.") for n in hf.tensor_files(path))
        cfg = dataclasses.replace(cfg, vision=None, image=None) if not tower else \
            dataclasses.replace(cfg, image=QwenImageSpec.from_checkpoint(
                path, hf.config_json(path)).with_limits(modes.image_limits()))
    return cfg


IMAGE_PAD = "<|image_pad|>"  # the placeholder Qwen's chat template writes for an image


def gguf_tower(cfg: Qwen35Config, path: Path, proj_path: Path) -> Qwen35Config:
    """A GGUF model's config with the vision tower of llama.cpp's mmproj file
    (``--mmproj``), its placeholder the GGUF vocabulary's ``<|image_pad|>``."""
    proj = hf.mmproj_file(proj_path)
    tokens = hf.gguf(path).model.meta.get("tokenizer.ggml.tokens") or []
    pad = next((i for i, t in enumerate(tokens) if t == IMAGE_PAD), None)
    if pad is None:
        raise CheckpointError(f"{path}: the vocabulary has no {IMAGE_PAD} token for the "
                              f"images of {proj_path.name}")
    vision = VisionConfig.from_hf(proj.vision_config())
    if vision.out_hidden != cfg.hidden_size:
        raise CheckpointError(f"{proj_path}: the tower's projection is {vision.out_hidden} "
                              f"wide, the model {cfg.hidden_size}: not this model's mmproj")
    mean, std = proj.normalization()
    spec = QwenImageSpec(placeholder=pad, patch=vision.patch, merge=vision.merge,
                         temporal=vision.temporal, mean=(mean[0], mean[1], mean[2]),
                         std=(std[0], std[1], std[2]))
    return dataclasses.replace(cfg, vision=vision,
                               image=spec.with_limits(modes.image_limits()))


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
                  describe_as("qwen3_5", "qwen3_5_moe"), rename_for=rename_for,
                  config_for=mtp_present)


class MtpHead:
    """The served model's MTP layers as a draft head (``ServedModel.draft_head``): per request
    a state, extended position by position, and logits through the model's head."""

    def __init__(self, model: Qwen35ForCausalLM) -> None:
        assert model.mtp is not None
        self.model, self.mtp = model, model.mtp
        self._native: tuple[Any, native_step.Plan | None] | None = None

    def native_plan(self) -> native_step.Plan | None:
        """The MTP layer as a native plan (None: no kernels, or a layer the native step does
        not take); rebuilt when the weights are replaced."""
        key = self.model.weights_key()
        if self._native is None or self._native[0] != key:
            found = mtp_plan(self.mtp, *native_step.head_tensors(self.model)) \
                if kernels.available() and self.model.native else None
            self._native = (key, found)
        return self._native[1]

    def new_state(self) -> State:
        return self.mtp.new_state()

    @torch.inference_mode()
    def extend(self, state: State, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """``hidden [n, d]`` (the final norm's output at n positions, or the head's own g)
        and the token after each -> g ``[n, d]`` fp32; ``state`` advanced by n."""
        plan = self.native_plan()
        kv = cast(KVEntry, state.layers[0]["kv"])
        state.reserve(int(state.lengths[0]) + len(tokens))
        if plan is not None and kv.k.is_contiguous() and kv.v.is_contiguous():
            g: torch.Tensor = torch.ops.linserve.decoder_mtp(
                plan.handle, torch.tensor(tokens), hidden.float().contiguous(), [kv.k, kv.v],
                state.lengths)
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

