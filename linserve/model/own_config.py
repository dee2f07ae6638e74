"""Model configuration: a frozen dataclass saved as ``config.json`` beside the weights."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

AttentionKind = Literal["linear", "favor", "softmax"]
ATTENTION_KINDS: tuple[str, ...] = ("linear", "favor", "softmax")
ROUND2_FIELDS = ("gate_rank", "window", "qk_norm", "output_norm", "head_decay")
EAGER_ONLY_FIELDS = ("qk_norm", "output_norm", "head_decay")  # ablations the fused step lacks


@dataclass(frozen=True)
class ModelConfig:
    """Architecture settings. Loading a checkpoint rebuilds the model from these, never from
    code defaults.

    ``conv_size`` is the width of the short causal depthwise convolution on q, k and v that
    gives ``linear``/``favor`` their position information (0 disables it: no positions at all).
    ``max_context`` caps only the full ``softmax`` baseline (its rotary table and KV cache).

    ``gate_rank > 0`` makes ``linear``/``favor`` *gated*: a data-dependent forget gate
    g_t ∈ [e⁻¹, 1] per head and feature (GLA's low-rank form, d → rank → H·F) decays the state,
    s_t = g_t ⊙ s_{t-1} + φ(k_t)v_tᵀ and z_t = g_t ⊙ z_{t-1} + φ(k_t).
    Three ablations of issue 13, carried by the eager forms only (the fused step refuses them):
    ``qk_norm`` L2-normalises each head's q and k before φ; ``output_norm`` replaces the
    denominator φ(q)ᵀz by GLA's per-head RMSNorm of φ(q)ᵀs (z is still kept, so the state keeps
    its shape); ``head_decay`` is a learned, data-independent decay per head (RetNet's γ, no
    gate network) in place of ``gate_rank``'s data-dependent gate.
    ``window > 0`` makes ``softmax`` local: each query sees only the last ``window`` tokens, so
    its KV cache is a ring buffer of constant size and it has no maximum context.
    """

    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    attention: AttentionKind = "linear"
    n_features: int = 64
    conv_size: int = 4
    max_context: int = 4096
    rope_base: float = 10000.0
    chunk_size: int = 64
    eps: float = 1e-6
    dropout: float = 0.0
    favor_seed: int = 0
    gate_rank: int = 0
    window: int = 0
    qk_norm: bool = False
    output_norm: bool = False
    head_decay: bool = False
    tokenizer: str = "tokenizer.json"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if self.head_dim % 2 and self.attention == "softmax":
            raise ValueError("rotary embeddings need an even head_dim")
        if self.gate_rank < 0 or (self.gate_rank and self.attention == "softmax"):
            raise ValueError("gate_rank must be >= 0 and is for linear or favor attention")
        for flag in ("qk_norm", "output_norm", "head_decay"):
            if getattr(self, flag) and self.attention == "softmax":
                raise ValueError(f"{flag} is for linear or favor attention")
        if self.head_decay and self.gate_rank:
            raise ValueError("head_decay replaces the gate: set gate_rank to 0")
        if self.output_norm and not (self.gate_rank or self.head_decay):
            raise ValueError("output_norm needs a decay (gate_rank or head_decay), as in GLA")
        if self.window < 0 or (self.window and self.attention != "softmax"):
            raise ValueError("window must be >= 0 and is for softmax attention")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def feature_dim(self) -> int:
        """Size of φ(q), φ(k): head_dim for elu+1, n_features for FAVOR+."""
        return self.n_features if self.attention == "favor" else self.head_dim

    @property
    def is_recurrent(self) -> bool:
        return self.attention in ("linear", "favor")

    @property
    def context_limit(self) -> int | None:
        """The longest sequence the model can hold: None for recurrent and windowed models."""
        return None if self.is_recurrent or self.window else self.max_context

    @property
    def truncatable(self) -> bool:
        """Whether a state can be cut back to a prefix by lowering its length: only a full KV
        cache. A recurrent state or a window's ring (which overwrote old slots) cannot; those
        are rebuilt from a snapshot instead."""
        return not self.is_recurrent and not self.window

    @property
    def kind(self) -> str:
        """The model family shown to users: linear, gated-linear, favor, gated-favor, softmax
        or window."""
        if self.gate_rank:
            return f"gated-{self.attention}"
        if self.head_decay:
            return f"decay-{self.attention}"
        return "window" if self.window else self.attention

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> dict[str, Any]:
        """The fields a model fingerprint covers: all, except the round-2 fields at their
        defaults, so older models keep their fingerprints and sessions exported from them
        still load."""
        return {k: v for k, v in self.to_dict().items()
                if not (k in ROUND2_FIELDS and not v)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config fields: {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
