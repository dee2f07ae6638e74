"""Per-sequence inference state, kept outside ``nn.Module`` so one model serves many sessions.

``LinearState`` (linear/favor) has a constant size whatever the sequence length;
``KVCache`` (softmax baseline) grows with it. Both are batched along dim 0, can select, split,
concatenate and copy rows, and serialise to safetensors bytes carrying a format version and
the fingerprint of the model that made them. Recurrent sums are always fp32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from model.config import ModelConfig

# 2 added "window" (a sliding-window model's ring size) to KV-cache blobs; version 1 blobs,
# from models without gates or windows, still load.
STATE_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = ("1", "2")
Index = torch.Tensor | Sequence[int] | slice


class StateError(ValueError):
    """A state blob that cannot be used with this model (wrong model, shape, dtype or format)."""


def _rows(t: torch.Tensor, idx: Index, dim: int = 0) -> torch.Tensor:
    """A copy of the rows ``idx`` along the batch dimension ``dim``."""
    # Copies are made contiguous explicitly: clone() keeps a strided view's layout where it
    # can and takes a slow path where it cannot (a KV row trimmed to its used slots: 0.56
    # against 0.11 ms).
    dense = torch.contiguous_format
    if isinstance(idx, slice):
        return t[(slice(None),) * dim + (idx,)].clone(memory_format=dense)
    if not isinstance(idx, torch.Tensor) and len(idx) == 1:  # one row: a plain strided copy
        return t.narrow(dim, int(idx[0]), 1).clone(memory_format=dense)
    # index_select already copies: a second copy would leave a freed buffer of the same
    # size between long-lived ones (heap fragmentation measured in the soak test).
    return t.index_select(dim, torch.as_tensor(idx, dtype=torch.long))


@dataclass
class LinearState:
    """s ``[L, B, H, F, M]`` = Σ φ(k)vᵀ, z ``[L, B, H, F]`` = Σ φ(k), and the short-conv buffer
    conv ``[L, B, K-1, 3·d_model]`` holding each layer's last K-1 q/k/v projections. All fp32.

    The layer dimension comes first so that one layer's slice of a batch (``s[l, :n]``) is a
    contiguous block: the decode step's batched matmuls then run on it without a copy.
    """

    s: torch.Tensor
    z: torch.Tensor
    conv: torch.Tensor
    kind: ClassVar[str] = "linear"

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int) -> LinearState:
        shape = (cfg.n_layers, batch, cfg.n_heads)
        return cls(
            s=torch.zeros(*shape, cfg.feature_dim, cfg.head_dim),
            z=torch.zeros(*shape, cfg.feature_dim),
            conv=torch.zeros(cfg.n_layers, batch, max(cfg.conv_size - 1, 0), 3 * cfg.d_model),
        )

    @property
    def batch_size(self) -> int:
        return self.s.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.s, self.z, self.conv))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"s": self.s, "z": self.z, "conv": self.conv}

    def select(self, idx: Index) -> LinearState:
        """A copy of the rows ``idx``."""
        return LinearState(_rows(self.s, idx, 1), _rows(self.z, idx, 1),
                           _rows(self.conv, idx, 1))

    def copy(self) -> LinearState:
        return self.select(slice(None))

    def write_rows(self, dst: Index, src: LinearState) -> None:
        """Copy ``src``'s rows into rows ``dst`` of this (pool) state, in place."""
        self.s[:, dst] = src.s
        self.z[:, dst] = src.z
        self.conv[:, dst] = src.conv

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` over row ``dst`` in place (no intermediate copy)."""
        for t in (self.s, self.z, self.conv):
            t[:, dst].copy_(t[:, src])

    @classmethod
    def cat(cls, states: Sequence[LinearState]) -> LinearState:
        return cls(*(torch.cat([getattr(st, n) for st in states], dim=1)
                     for n in ("s", "z", "conv")))

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        ref = LinearState.empty(cfg, self.batch_size)
        return {k: tuple(v.shape) for k, v in ref.tensors().items()}


@dataclass
class KVCache:
    """Preallocated keys and values ``[B, L, H, C, D]``, written in place at each row's own
    length ``lengths [B]``. Capacity C grows by doubling, never per step, up to ``max_context``.

    With ``window = W > 0`` (a sliding-window model) the cache is a ring of at most W slots:
    position p lives in slot p mod W, ``lengths`` still counts every token seen, and the
    cache never grows past W slots, whatever the length.
    """

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    max_context: int
    window: int = 0
    kind: ClassVar[str] = "softmax"

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, capacity: int = 0,
              dtype: torch.dtype = torch.float32) -> KVCache:
        limit = cfg.window or cfg.max_context
        cap = min(max(capacity, 16), limit)
        shape = (batch, cfg.n_layers, cfg.n_heads, cap, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                   torch.zeros(batch, dtype=torch.long), cfg.max_context, cfg.window)

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def slot_limit(self) -> int:
        """The most slots this cache may ever hold: W for a window model, else max_context."""
        return self.window or self.max_context

    def slots_used(self, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Slots holding keys per row ``[B]``: the length, capped at W for a window model."""
        lengths = self.lengths if lengths is None else lengths
        return lengths.clamp(max=self.window) if self.window else lengths

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + self.lengths.numel() * 8

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "lengths": self.lengths}

    def rows(self, n: int) -> KVCache:
        """The first ``n`` rows as a view sharing this cache's memory."""
        return KVCache(self.k[:n], self.v[:n], self.lengths[:n], self.max_context, self.window)

    def ensure_capacity(self, needed: int, live: int | None = None) -> None:
        """Make room for ``needed`` positions per row (doubling; amortised O(1) per token).
        A window model needs at most W slots, so it never refuses a length. ``live``: see
        :meth:`resize`."""
        if self.window:
            needed = min(needed, self.window)
        elif needed > self.max_context:
            raise ValueError(f"context of {needed} tokens exceeds max_context {self.max_context}")
        if needed <= self.capacity:
            return
        pow2 = 1 << (needed - 1).bit_length()
        self.resize(min(max(2 * self.capacity, pow2), self.slot_limit), live)

    def resize(self, capacity: int, live: int | None = None) -> None:
        """Reallocate to exactly ``capacity`` slots (≥ the most any row uses), copying. A ring
        only wraps once it holds W slots, so growing it never reorders anything.

        ``live = n`` (a slot pool) copies and zero-fills only rows ``[0, n)``; the other rows
        are left unwritten until :meth:`write_rows` fills one whole. The pool holds a row per
        possible sequence, so at 64 rows and 2,048 slots a full copy is 1 GiB: it stalled the
        batch for 2.5 s when one conversation first passed 1,024 tokens."""
        if capacity == self.capacity:
            return
        keep = min(capacity, self.capacity)
        rows = self.batch_size if live is None else live
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:3], capacity, old.shape[4])
            new[:rows, :, :, :keep] = old[:rows, :, :, :keep]
            new[:rows, :, :, keep:] = 0  # masked-out slots must hold numbers, not garbage
            setattr(self, name, new)

    def select(self, idx: Index) -> KVCache:
        """A copy of the rows ``idx``, trimmed to the capacity they need."""
        lengths = _rows(self.lengths, idx)
        used = int(self.slots_used(lengths).max()) if lengths.numel() else 0
        cap = min(max(16, 1 << max(used - 1, 0).bit_length()), self.slot_limit)
        cap = max(cap, used)
        k = _rows(self.k[:, :, :, :cap], idx)
        v = _rows(self.v[:, :, :, :cap], idx)
        return KVCache(k, v, lengths, self.max_context, self.window)

    def copy(self) -> KVCache:
        return self.select(slice(None))

    def write_rows(self, dst: Index, src: KVCache) -> None:
        """Copy ``src``'s rows into rows ``dst`` of this (pool) cache, in place; the rows'
        slots past ``src``'s capacity are zeroed (they may hold anything after a live-only
        :meth:`resize`)."""
        used = src.capacity
        self.ensure_capacity(used)
        self.k[dst, :, :, :used] = src.k
        self.v[dst, :, :, :used] = src.v
        self.k[dst, :, :, used:] = 0
        self.v[dst, :, :, used:] = 0
        self.lengths[dst] = src.lengths

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` over row ``dst`` in place (no intermediate copy)."""
        for t in (self.k, self.v, self.lengths):
            t[dst].copy_(t[src])

    @classmethod
    def cat(cls, states: Sequence[KVCache]) -> KVCache:
        cap = max(st.capacity for st in states)
        for st in states:
            st.resize(cap)
        return cls(torch.cat([st.k for st in states]), torch.cat([st.v for st in states]),
                   torch.cat([st.lengths for st in states]), states[0].max_context,
                   states[0].window)

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        b, c = self.batch_size, self.capacity
        limit = cfg.window or cfg.max_context
        if c > limit:
            raise StateError(f"KV cache capacity {c} exceeds the model's limit of {limit} slots")
        if self.lengths.numel() and (int(self.lengths.min()) < 0
                                     or int(self.slots_used().max()) > c):
            raise StateError("KV cache lengths are out of range")
        kv = (b, cfg.n_layers, cfg.n_heads, c, cfg.head_dim)
        return {"k": kv, "v": kv, "lengths": (b,)}


State = LinearState | KVCache


def empty_state(cfg: ModelConfig, batch: int = 1) -> State:
    """A fresh state of the right kind for ``cfg``."""
    return LinearState.empty(cfg, batch) if cfg.is_recurrent else KVCache.empty(cfg, batch)


def cat_states(states: Sequence[State]) -> State:
    """Concatenate states of one kind along the batch dimension."""
    if all(isinstance(st, LinearState) for st in states):
        return LinearState.cat([st for st in states if isinstance(st, LinearState)])
    if all(isinstance(st, KVCache) for st in states):
        return KVCache.cat([st for st in states if isinstance(st, KVCache)])
    raise TypeError("cannot concatenate states of different kinds")


def unbatch(state: State) -> list[State]:
    """Split a batched state into single-row copies."""
    return [state.select([i]) for i in range(state.batch_size)]


def state_to_bytes(state: State, fingerprint: str, extra: dict[str, Any] | None = None) -> bytes:
    """Serialise to safetensors bytes with format version, kind and model fingerprint."""
    meta = {"format_version": str(STATE_FORMAT_VERSION), "kind": state.kind,
            "fingerprint": fingerprint, "extra": json.dumps(extra or {})}
    if isinstance(state, KVCache):
        meta["window"] = str(state.window)
    tensors = {k: v.contiguous() for k, v in state.tensors().items()}
    return st_save(tensors, metadata=meta)


def _read_header(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise StateError("state blob is truncated")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise StateError("state blob is truncated or not safetensors")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateError("state blob header is not valid safetensors JSON") from exc
    if not isinstance(header, dict):
        raise StateError("state blob header is not a JSON object")
    return header


def state_from_bytes(data: bytes, cfg: ModelConfig, fingerprint: str
                     ) -> tuple[State, dict[str, Any]]:
    """Parse and validate a blob made by :func:`state_to_bytes`; returns (state, extra).

    Raises :class:`StateError` for another model's state, a wrong kind, shape or dtype, or
    anything that is not a well-formed safetensors blob. Nothing is unpickled.
    """
    meta = _read_header(data).get("__metadata__") or {}
    if meta.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise StateError(f"unsupported state format version {meta.get('format_version')!r} "
                         f"(this server reads {', '.join(READABLE_FORMAT_VERSIONS)})")
    expected_kind = "linear" if cfg.is_recurrent else "softmax"
    if meta.get("kind") != expected_kind:
        raise StateError(f"state kind {meta.get('kind')!r} does not match model ({expected_kind})")
    if meta.get("fingerprint") != fingerprint:
        raise StateError("state was made by a different model (fingerprint mismatch)")
    if not cfg.is_recurrent and meta.get("window", "0") != str(cfg.window):
        raise StateError(f"state is a KV cache for window {meta.get('window', '0')!r}; "
                         f"this model's window is {cfg.window}")
    try:
        tensors = st_load(data)
        extra = json.loads(meta.get("extra", "{}"))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise StateError(f"state blob is corrupt: {exc}") from exc
    return _build_state(tensors, cfg), extra if isinstance(extra, dict) else {}


def _build_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> State:
    state: State
    try:
        if cfg.is_recurrent:
            state = LinearState(tensors["s"], tensors["z"], tensors["conv"])
        else:
            state = KVCache(tensors["k"], tensors["v"], tensors["lengths"], cfg.max_context,
                            cfg.window)
    except KeyError as exc:
        raise StateError(f"state blob lacks tensor {exc}") from exc
    if set(tensors) != set(state.tensors()):
        raise StateError("state blob has unexpected tensors")
    expected = state.expected_shapes(cfg)
    for name, tensor in state.tensors().items():
        want_dtype = torch.long if name == "lengths" else torch.float32
        if tensor.dtype != want_dtype:
            raise StateError(f"state tensor {name} has dtype {tensor.dtype}, expected {want_dtype}")
        if tuple(tensor.shape) != expected[name]:
            raise StateError(f"state tensor {name} has shape {tuple(tensor.shape)}, "
                             f"expected {expected[name]}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise StateError(f"state tensor {name} holds NaN or inf")
    return state
