"""Tiny random models for fast unit tests."""

from __future__ import annotations

from pathlib import Path

import torch

from linserve.model.architectures.own_model import LanguageModel, serve
from linserve.model.kernels import cpu_flags
from linserve.model.own_config import ModelConfig
from linserve.model.served import ServedModule
from linserve.model.tokenizer import Tokenizer

TOKENIZER = Path(__file__).resolve().parents[2] / "weights" / "tokenizer.json"

# Test kinds beyond the three attention maps: gated linear attention (elu+1 or FAVOR+) and
# sliding-window softmax. The window is small so that tests cross it many times.
VARIANTS: dict[str, dict[str, object]] = {
    "gated": {"attention": "linear", "gate_rank": 4},
    "gated-favor": {"attention": "favor", "gate_rank": 4},
    "window": {"attention": "softmax", "window": 24},
}


def tiny_config(kind: str = "linear", **overrides: object) -> ModelConfig:
    """A tiny config of ``kind``: an attention map or one of :data:`VARIANTS`."""
    base: dict[str, object] = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                   attention=kind, chunk_size=16, n_features=32, max_context=512)
    base.update(VARIANTS.get(kind, {}))
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def tiny_model(kind: str = "linear", seed: int = 0, **overrides: object) -> LanguageModel:
    torch.manual_seed(seed)
    model = LanguageModel(tiny_config(kind, **overrides)).eval()
    # Larger-than-init weights so attention patterns are far from uniform.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0 if p.dim() > 1 else 1.0)
    return model


def served(model: LanguageModel, tok: Tokenizer | None = None) -> ServedModule:
    """``model`` behind the server's model interface (with the shipped tokenizer)."""
    return serve(model, tok if tok is not None else Tokenizer.from_file(TOKENIZER))


AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})


def forced_avx2_runs_new_paths() -> bool:
    """Whether a run with ATen and the kernels forced to AVX2 (``x86-64-v3``) tests paths the
    main run does not: on a CPU with AVX-512. On one without, the main run already is an
    AVX2 machine's (ATen's AVX2 paths, the kernels built for AVX2), and the forced runs' own
    build cost 160 s of CI on a Zen 3."""
    flags = cpu_flags()
    return {"avx2", "fma", "bmi2"} <= flags and flags >= AVX512
