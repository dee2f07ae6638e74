"""Loading the model for the engine: weights, dtype, threads, tokenizer, and a warm-up.

Shared by the engine process and the thread mode; kept out of ``server.app`` so that the
engine process does not import the app that starts it.
"""

from __future__ import annotations

import logging

import torch

from model.tokenizer import Tokenizer
from model.transformer import LanguageModel, load_model
from server.cpus import available_cpus
from server.settings import Settings

log = logging.getLogger("linserve")


def load_engine_model(settings: Settings) -> tuple[LanguageModel, Tokenizer]:
    torch.set_num_threads(settings.threads or max(1, available_cpus() - 1))
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    model = load_model(settings.weights, dtype, fused=settings.fused_step)
    log.info("decode step: %s", "fused native" if model.uses_fused_step else "eager")
    tok = Tokenizer.from_file(settings.weights / model.cfg.tokenizer)
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens, model {model.cfg.vocab_size}")
    return model, tok


def warm_up(model: LanguageModel) -> None:
    """Run each form once so the first request does not pay for lazy initialisation."""
    _, state = model.prefill(torch.zeros(1, 8, dtype=torch.long))
    model.step(torch.zeros(1, dtype=torch.long), state)
