"""Loading the model for the engine: weights, dtype, threads, tokenizer, and a warm-up.

Shared by the engine process and the thread mode; kept out of ``server.app`` so that the
engine process does not import the app that starts it.
"""

from __future__ import annotations

import logging

import torch

from model import invariant
from model.kernels import cpu_flags
from model.tokenizer import Tokenizer
from model.transformer import LanguageModel, load_model
from server.cpus import available_cpus
from server.settings import Settings

log = logging.getLogger("linserve")

# CPU flags (as /proc/cpuinfo names them) of native bf16 dot products: AVX512-BF16's
# vdpbf16ps and AMX's tile products. Without them oneDNN emulates bf16 through fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def pick_dtype(requested: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """The weight dtype to load (``float32`` or ``bfloat16``) and why, for the startup log
    and ``/health``. ``auto`` is bf16 exactly where the CPU has native bf16 products."""
    if requested != "auto":
        return requested, f"--dtype {requested} was set"
    have = [f for f in BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return "bfloat16", f"auto: the CPU has native bf16 dot products ({', '.join(have)})"
    return "float32", "auto: the CPU has neither AVX512-BF16 nor AMX, so bf16 would be emulated"


def load_engine_model(settings: Settings) -> tuple[LanguageModel, Tokenizer]:
    torch.set_num_threads(settings.threads or max(1, available_cpus() - 1))
    name, reason = pick_dtype(settings.dtype)
    invariant.set_enabled(settings.batch_invariant)
    model = load_model(settings.weights, getattr(torch, name), fused=settings.fused_step)
    log.info("decode step: %s; weights %s (%s); batch-invariant %s",
             "fused native" if model.uses_fused_step else "eager", name, reason,
             "on" if invariant.active() else "off")
    tok = Tokenizer.from_file(settings.weights / model.cfg.tokenizer)
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens, model {model.cfg.vocab_size}")
    return model, tok


def warm_up(model: LanguageModel) -> None:
    """Run each form once so the first request does not pay for lazy initialisation."""
    _, state = model.prefill(torch.zeros(1, 8, dtype=torch.long))
    model.step(torch.zeros(1, dtype=torch.long), state)
