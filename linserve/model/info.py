"""What the server knows of a model without running it, torch-free: :class:`ModelInfo`,
and the errors a checkpoint or a state gives (:class:`CheckpointError`, :class:`StateError`).
The HTTP process imports this, never the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATE_FORMAT_VERSION = 3  # the session blob's format (linserve.model.state_blob)


class StateError(ValueError):
    """A state blob that cannot be used with this model (wrong model, shape, dtype or format)."""


class CheckpointError(ValueError):
    """A checkpoint this server cannot load; the message is one line for the startup log."""


@dataclass(frozen=True)
class ModelInfo:
    """What the server may know about a loaded model.

    ``context_limit``: the longest sequence it serves (None: no limit). ``ragged_prefill``:
    whether :meth:`ServedModel.prefill_ragged` takes prompts of different lengths in one pass.
    ``state_bytes``: one fresh session's state; ``state_grows``: whether that grows with the
    context (a KV cache), by ``state_bytes_per_token``. ``state_layout``: per layer, what it
    holds. ``weight_bytes``: what the weights hold in memory as served (packed, quantized),
    of which ``embedding_bytes`` are an embedding table held beside the head."""

    architecture: str
    vocab_size: int
    context_limit: int | None
    params: int
    dtype: str
    decode_step: str  # "fused" (one native call per step) or "eager"
    ragged_prefill: bool
    state_bytes: int
    state_grows: bool
    state_layout: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    state_bytes_per_token: int = 0  # what each token adds (its KV entries); 0: constant
    weight_bytes: int = 0
    embedding_bytes: int = 0
    quantization: str = "none"  # "int8" / "int4" GEMM weights (model.quantize), or none
    notes: tuple[str, ...] = ()
    kv_cache_dtype: str = ""  # what its KV caches hold (fp32, bf16, int8); "": none
    input_kinds: tuple[str, ...] = ()  # what it takes besides text ("image"): its encoders
    image_spec: Any = None  # how its images become tokens (linserve.model.vision; torch-free)
