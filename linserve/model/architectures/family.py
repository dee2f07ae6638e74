"""A Hugging Face architecture family as data: which ``model_type`` values it serves, how it
reads its config, builds its module (a :class:`linserve.model.layers.decoder.DecoderLM`) and names
its tensors. Everything else, recognising a folder, checking it before reading weights,
sizing its state, loading, packing and serving, is the same for every family and lives
here, so a new family is one module that defines a :class:`HFFamily`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Self

import torch

from linserve.model import packing
from linserve.model.architectures import hf
from linserve.model.layers.decoder import DecoderLM
from linserve.model.layers.hf_keys import json_float
from linserve.model.layers.moe import split_stacked
from linserve.model.served import ServedModule, describe
from linserve.model.state import KVEntry

__all__ = ["DecoderConfig", "HFFamily", "json_float", "layer_types", "renamer",
           "require_activation", "state_sizes"]
log = logging.getLogger("linserve")


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """The fields every Hugging Face family's config shares, read alike from config.json
    (:meth:`shared`); each family's config (``Lfm2Config``, ``Qwen35Config``, …) adds its
    own fields beside them."""

    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @staticmethod
    def shared(c: dict[str, Any], max_positions: int, tie: bool) -> dict[str, Any]:
        """The shared fields of ``c`` (config.json, or its text part), with the family's
        defaults for the two a checkpoint may leave out."""
        return {"vocab_size": int(c["vocab_size"]), "hidden_size": int(c["hidden_size"]),
                "max_position_embeddings": int(c.get("max_position_embeddings", max_positions)),
                "tie_word_embeddings": bool(c.get("tie_word_embeddings", tie))}

    def tied(self, tie: bool) -> Self:
        """This config with ``tie_word_embeddings`` as the family decides it (where it is
        not config.json's field alone)."""
        return dataclasses.replace(self, tie_word_embeddings=tie)


@dataclass(frozen=True)
class HFFamily:
    """How a Hugging Face family's checkpoints load: its module's ``FAMILY`` (the registry,
    :mod:`.registry`, names the family and its ``model_type`` values). ``config``: the
    parsed config from ``config.json``'s dict (raises KeyError, TypeError or ValueError
    naming what is wrong). ``build``: the module for a config. ``rename``: a checkpoint
    tensor's name in that module (None: not ours), or ``rename_for``: that mapping for a
    config (where it depends on one, as Granite's shared MLP does on whether there are
    experts). ``describe``: one line for ``/v1/models`` and the startup log. ``split_for``:
    how a config's checkpoint tensors that fill several parameters split (default: stacked
    experts). ``config_for``: the config adjusted to what the checkpoint at a path holds
    (Qwen3.5's MTP layers, counted only where their tensors are)."""

    config: Callable[[dict[str, Any]], Any]
    build: Callable[[Any], DecoderLM]
    rename: Callable[[str], str | None]
    describe: Callable[[Any], str]
    rename_for: Callable[[Any], Callable[[str], str | None]] | None = None
    split_for: Callable[[Any], hf.Split] | None = None
    config_for: Callable[[Any, Path], Any] | None = None

    def renames(self, cfg: Any) -> Callable[[str], str | None]:
        return self.rename if self.rename_for is None else self.rename_for(cfg)

    def splits(self, cfg: Any) -> hf.Split:
        return split_stacked if self.split_for is None else self.split_for(cfg)

    def read_config(self, path: Path) -> Any:
        cfg = hf.parse_config(path, self.config)
        return cfg if self.config_for is None else self.config_for(cfg, path)

    def _meta(self, cfg: Any) -> DecoderLM:
        with torch.device("meta"):
            return self.build(cfg)

    def max_state_bytes(self, path: Path) -> int:
        """The largest one-session state: its constant part plus a full-context KV cache."""
        cfg = self.read_config(path)
        return state_sizes(self._meta(cfg), cfg.max_position_embeddings)[0]

    def params(self, path: Path) -> int:
        """Parameters of the module ``path``'s config builds (read nothing else)."""
        return self._meta(self.read_config(path)).n_params()

    @hf.checked_once
    def check(self, path: Path, dtype: torch.dtype) -> None:
        """Everything that can be checked before reading weights: the config, every
        tensor's presence and shape (from the safetensors headers), and the tokenizer.
        Raises :class:`CheckpointError`."""
        del dtype  # the weights' memory is checked by model.loader.check, for every family
        cfg = self.read_config(path)
        hf.plan(self._meta(cfg), path, self.renames(cfg), self.splits(cfg))
        hf.load_tokenizer(path, hf.config_json(path), cfg.vocab_size)

    def load(self, path: Path, dtype: torch.dtype, fused: bool, weights: bool = True
             ) -> ServedModule:
        """Build the module from ``path``'s config, load its weights, tokenizer and chat
        template, pack every GEMM weight and free the originals (``weights=False``: the
        module stays on the meta device, see :func:`linserve.model.loader.load`)."""
        self.check(path, dtype)
        cfg = self.read_config(path)
        tok = hf.load_tokenizer(path, hf.config_json(path), cfg.vocab_size)
        # in the served dtype from the start: a bf16 model never exists in fp32 as well
        module = hf.cast(self._meta(cfg), dtype).eval()
        module.native = fused
        native = False
        if weights:
            module = hf.materialise(module)
            with packing.packing_once(module):  # packed layer by layer as it is read
                unused = hf.load_weights(module, path, self.renames(cfg), dtype, module,
                                         self.splits(cfg))
                native = module.prepare(fused)  # anything the layers alone did not build
            _log_unused(path, unused)
        per_token = state_sizes(module, cfg.max_position_embeddings)[1]
        info = describe(module, self.describe(cfg), cfg.max_position_embeddings, per_token,
                        decode_step=None if native else "eager (layer by layer)")
        served = ServedModule(module, tok, hf.chat_template(path),
                              partial(hf.fingerprint, path), info)
        for kind, encoder in getattr(module, "encoders", dict)().items():
            served.add_encoder(kind, encoder)  # a vision tower's images
        return served


# What a vision-language checkpoint holds beside its text model (left unread here).
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")


def _log_unused(path: Path, unused: list[str]) -> None:
    """Say what of the checkpoint was not loaded: a vision tower in one line, and anything
    else (a tied head's copy aside) as a warning."""
    vision = sum(n.startswith(VISION_PREFIXES) for n in unused)
    if vision:
        log.info("%s: a vision-language checkpoint; loaded its text model only (%d vision "
                 "tensors skipped)", path, vision)
    other = [n for n in unused if not n.startswith((*VISION_PREFIXES, "lm_head."))]
    if other:
        log.warning("%s: %d checkpoint tensors unused, e.g. %s", path, len(other), other[0])


def require_activation(c: dict[str, Any], served: str = "silu", key: str = "hidden_act"
                       ) -> None:
    """Raise ValueError unless config.json's ``key`` (absent: the default) is ``served``."""
    if c.get(key, served) != served:
        raise ValueError(f"{key} {c[key]!r} is not served ({served} is)")


def layer_types(c: dict[str, Any], kinds: tuple[str, ...]) -> tuple[str, ...]:
    """config.json's ``layer_types``: one of ``kinds`` for each of ``num_hidden_layers``
    (ValueError naming what is wrong otherwise)."""
    n = int(c["num_hidden_layers"])
    types = tuple(c.get("layer_types") or [])
    if len(types) != n or set(types) - set(kinds):
        raise ValueError(f"layer_types {list(types)!r} is not {n} of {' / '.join(kinds)}")
    return types


def renamer(rules: list[tuple[str, str]]) -> Callable[[str], str]:
    """A checkpoint-name mapping from ``(regex, replacement)`` rules: the first rule that
    matches a name rewrites it; a name no rule matches stays as it is."""
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]

    def rename(name: str) -> str:
        for pattern, repl in compiled:
            new, hits = pattern.subn(repl, name)
            if hits:
                return new
        return name

    return rename


def state_sizes(module: DecoderLM, max_context: int) -> tuple[int, int]:
    """(the largest one-session state in bytes, the bytes each token of context adds): the
    constant entries of a fresh state plus its full KV caches (in ``--kv-cache-dtype``)."""
    state = module.new_state(1, max_context)
    per_token = sum(e.slot_bytes for e in state.entries()
                    if isinstance(e, KVEntry) and not e.window)
    constant = sum(e.nbytes for e in state.entries() if not isinstance(e, KVEntry))
    return constant + per_token * max_context + 8, per_token
