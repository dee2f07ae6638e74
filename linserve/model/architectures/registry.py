"""Every architecture family the server serves, registered once.

A :class:`Family` names a family, the Hugging Face ``model_type`` values and GGUF
``general.architecture`` values it serves, and the module whose ``FAMILY`` object checks
and loads its checkpoints (a :class:`CheckpointLoader`). The loader, the GGUF reader, the
documents' tables and the tests all read this one list; nothing here imports torch, so
recognising a checkpoint costs only reading its ``config.json``, and a family's module is
imported only when one of its checkpoints is loaded (as vLLM's model registry does).

Adding a family: its module under ``linserve/model/architectures/`` with a ``FAMILY``, and
one entry here (``docs/architecture.md``, "Adding a model family", lists every file).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from linserve.model.interface import ServedModel

PACKAGE = "linserve.model.architectures"


class CheckpointLoader(Protocol):
    """What a family module's ``FAMILY`` does with one of its checkpoints (a folder, or a
    GGUF file standing for one). ``check`` raises ``CheckpointError`` naming what is wrong,
    before any weight is read; ``load`` with ``weights=False`` describes the model without
    reading its weights (config, tokenizer, template, states and their codec)."""

    def check(self, path: Path, dtype: torch.dtype) -> None: ...

    def load(self, path: Path, dtype: torch.dtype, fused: bool, weights: bool = True
             ) -> ServedModel: ...

    def max_state_bytes(self, path: Path) -> int: ...

    def params(self, path: Path) -> int: ...


@dataclass(frozen=True)
class Family:
    """One architecture family. ``module``: its module under ``architectures/`` (its
    ``FAMILY`` is the loader); ``title``: how the documents name it; ``model_types``: the
    ``config.json`` values it serves (none for the project's own checkpoints, recognised by
    their config's ``attention``); ``gguf_archs``: the GGUF architectures whose files it
    serves (:mod:`linserve.model.gguf.archs` maps their metadata)."""

    name: str
    title: str
    module: str
    model_types: tuple[str, ...] = ()
    gguf_archs: tuple[str, ...] = ()

    def loader(self) -> CheckpointLoader:
        """The family module's ``FAMILY`` (the module imported on first use)."""
        loader: CheckpointLoader = importlib.import_module(f"{PACKAGE}.{self.module}").FAMILY
        return loader


OWN = Family("linserve", "the project's own (linear, softmax, window, FAVOR+)", "own_model")
FAMILIES: tuple[Family, ...] = (
    OWN,
    Family("qwen3_5", "Qwen3.5, Qwen3.5-MoE", "qwen3_5",
           ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
           ("qwen35", "qwen35moe")),
    Family("qwen3_next", "Qwen3-Next", "qwen3_next", ("qwen3_next",), ("qwen3next",)),
    Family("lfm2", "LFM2, LFM2.5, LFM2-VL", "lfm2", ("lfm2", "lfm2_vl"), ("lfm2",)),
    Family("lfm2_moe", "LFM2-MoE", "lfm2_moe", ("lfm2_moe",), ("lfm2moe",)),
    Family("lfm3", "LFM3", "lfm3", ("lfm3",)),
    Family("granite_hybrid", "Granite-4.0-H", "granite_hybrid", ("granitemoehybrid",),
           ("granitehybrid",)),
    Family("nemotron_h", "Nemotron-H, Nemotron-3", "nemotron_h", ("nemotron_h",),
           ("nemotron_h", "nemotron_h_moe")),
    Family("falcon_h1", "Falcon-H1", "falcon_h1", ("falcon_h1",), ("falcon-h1",)),
    Family("bamba", "Bamba", "bamba", ("bamba",), ("granitehybrid",)),
    Family("mamba", "Mamba, Falcon-Mamba", "mamba", ("mamba", "falcon_mamba"), ("mamba",)),
    Family("mamba2", "Mamba2", "mamba2", ("mamba2",), ("mamba2",)),
    Family("jamba", "Jamba", "jamba", ("jamba",), ("jamba",)),
    Family("zamba2", "Zamba2", "zamba2", ("zamba2",)),
    Family("recurrent_gemma", "RecurrentGemma", "recurrent_gemma", ("recurrent_gemma",)),
    Family("olmo_hybrid", "OLMo-Hybrid", "olmo_hybrid", ("olmo_hybrid",)),
    Family("kimi_linear", "Kimi-Linear", "kimi_linear", ("kimi_linear",), ("kimi-linear",)),
    Family("bailing_hybrid", "Ling hybrids", "bailing_hybrid", ("bailing_hybrid",),
           ("bailingmoe3",)),
    Family("minimax", "MiniMax-Text-01", "minimax", ("minimax",)),
    Family("rwkv7", "RWKV-7", "rwkv7", ("rwkv7", "rwkv7_fla"), ("rwkv7",)),
    Family("rwkv6", "RWKV-6", "rwkv6", ("rwkv6",), ("rwkv6",)),
    Family("rwkv4", "RWKV-4", "rwkv4", ("rwkv",)),
    Family("xlstm", "xLSTM", "xlstm", ("xlstm",)),
)
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def by_name(name: str) -> Family:
    """The family called ``name`` (KeyError otherwise)."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(name)


def known_model_types() -> list[str]:
    """Every Hugging Face ``model_type`` some family serves."""
    return list(BY_MODEL_TYPE)


def gguf_archs() -> set[str]:
    """Every GGUF architecture some family serves."""
    return {a for f in FAMILIES for a in f.gguf_archs}


def recognise(config: dict[str, Any]) -> Family | None:
    """The family of a checkpoint whose ``config.json`` is ``config`` (None: unknown). The
    project's own checkpoints name their attention instead of a ``model_type``."""
    if "attention" in config:
        return OWN
    return BY_MODEL_TYPE.get(str(config.get("model_type")))

