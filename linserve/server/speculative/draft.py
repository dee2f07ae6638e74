"""The draft checkpoint of ``draft_model``: resolved, checked against the served model's
vocabulary at start-up (one line when it differs), and loaded beside it in the engine."""

from __future__ import annotations

from pathlib import Path

import torch

from linserve.model import loader
from linserve.model.interface import CheckpointError, ServedModel
from linserve.server.speculative.config import SpeculativeConfig


def draft_path(config: SpeculativeConfig) -> Path:
    """The draft checkpoint's folder or file (a hub id through the local cache)."""
    assert config.model is not None
    return loader.resolve(config.model)


def check_draft(config: SpeculativeConfig, target: Path) -> Path:
    """Raise :class:`CheckpointError` unless the draft loads and tokenizes as ``target``
    does (every token id the same text); returns its path."""
    path = draft_path(config)
    loader.check(path)
    draft = loader.load(path, weights=False)
    served = loader.load(target, weights=False)
    a, b = draft.tokenizer(), served.tokenizer()
    size = max(draft.info.vocab_size, served.info.vocab_size)
    if any(a.token_text(i) != b.token_text(i) for i in range(size)):
        raise CheckpointError(f"the draft model {config.model} has another vocabulary than "
                              f"the served model (draft_model needs the same tokenizer)")
    return path


def check_speculative(config: SpeculativeConfig, target: Path) -> None:
    """Raise :class:`CheckpointError` (one line) for a config this checkpoint cannot serve:
    a draft model that does not load or tokenizes otherwise, MTP without ``mtp.*`` layers."""
    if config.method == "draft_model":
        check_draft(config, target)
    elif config.method == "mtp" and loader.load(target, weights=False).draft_head() is None:
        raise CheckpointError(f"{target} has no MTP layers (mtp.* tensors) for "
                              f'"method": "mtp"; use "ngram" or "draft_model"')


def load_draft(config: SpeculativeConfig | None, dtype: str, fused: bool,
               batch_invariant: bool, quantization: str) -> ServedModel | None:
    """The draft model of a ``draft_model`` config (None for other methods), loaded and run
    once with the served model's settings. Load it before the served model: loading sets
    the process's GEMM modes, which must end as the served model's."""
    if config is None or config.method != "draft_model":
        return None
    draft = loader.load(draft_path(config), dtype, fused, batch_invariant, quantization)
    _, state = draft.prefill(torch.zeros(1, 4, dtype=torch.long))
    draft.step(torch.zeros(1, dtype=torch.long), state)
    return draft
