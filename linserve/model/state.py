"""Per-sequence inference state: a sequence of per-layer entries, batched along dim 0.

One model serves many sessions, so state lives outside ``nn.Module``. A :class:`State` holds,
for each layer, a small dict of named entries, plus ``lengths [B]``: the tokens each row has
consumed (the position of its next token). An entry is one of:

- :class:`RecurrentEntry`: a matrix state per head, s ``[B, H, F, M]``, and where the model
  normalises by it z ``[B, H, F]``; constant size, fp32.
- :class:`ConvEntry`: a short causal convolution's window, ``[B, K-1, C]`` fp32.
- :class:`KVEntry`: keys and values ``[B, H, C, D]`` in C slots that grow in blocks of 256 up to
  a limit; with ``window = W`` a ring of W slots that never grows past W.

A model may mix entry types across layers (a hybrid keeps recurrent and conv entries in most
layers and a KV cache in a few). Every entry selects, copies, concatenates, writes and moves
rows, and knows its bytes and whether it can be cut back to a prefix (only a KV cache can:
a recurrent sum cannot be un-added). The server sees only :class:`State`'s methods.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from linserve.model.info import StateError  # noqa: F401 (re-exported: a state's error)

Index = torch.Tensor | Sequence[int] | slice


KV_BLOCK = 256  # slots a KV cache grows by


def _blocks(positions: int) -> int:
    """``positions`` rounded up to whole :data:`KV_BLOCK` blocks."""
    return -(-positions // KV_BLOCK) * KV_BLOCK


def _rows(t: torch.Tensor, idx: Index) -> torch.Tensor:
    """A contiguous copy of the rows ``idx`` (dim 0)."""
    # Copies are made contiguous explicitly: clone() keeps a strided view's layout where it
    # can and takes a slow path where it cannot (a KV row trimmed to its used slots: 0.56
    # against 0.11 ms).
    dense = torch.contiguous_format
    if isinstance(idx, slice):
        return t[idx].clone(memory_format=dense)
    if not isinstance(idx, torch.Tensor) and len(idx) == 1:  # one row: a plain strided copy
        return t.narrow(0, int(idx[0]), 1).clone(memory_format=dense)
    # index_select already copies: a second copy would leave a freed buffer of the same
    # size between long-lived ones (heap fragmentation measured in the soak test).
    return t.index_select(0, torch.as_tensor(idx, dtype=torch.long))


@dataclass
class Entry:
    """One layer's piece of state. Subclasses name their tensors in ``TENSORS`` (all batched
    on dim 0); other dataclass fields are parameters (a ring's window)."""

    KIND: ClassVar[str] = ""
    TENSORS: ClassVar[tuple[str, ...]] = ()
    DTYPE: ClassVar[torch.dtype] = torch.float32  # its tensors' dtype (a blob checks it)

    @property
    def truncatable(self) -> bool:
        """Whether the entry can be cut back to a prefix of what it has consumed."""
        return False

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` holds (a blob checks it)."""
        return self.DTYPE

    def tensors(self) -> dict[str, torch.Tensor]:
        """The entry's tensors by name (absent optional ones left out)."""
        return {n: t for n in self.TENSORS if (t := getattr(self, n)) is not None}

    def params(self) -> dict[str, Any]:
        """Everything but the tensors: what a blob's layout records."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self.TENSORS and f.init}

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors().values())).shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def _with(self, tensors: dict[str, torch.Tensor]) -> Entry:
        return dataclasses.replace(self, **tensors)

    def select(self, idx: Index, lengths: torch.Tensor) -> Entry:
        """A copy of rows ``idx`` (``lengths``: those rows' token counts)."""
        return self._with({n: _rows(t, idx) for n, t in self.tensors().items()})

    def rows(self, n: int) -> Entry:
        """The first ``n`` rows as a view sharing this entry's memory."""
        return self._with({k: t[:n] for k, t in self.tensors().items()})

    def write_rows(self, dst: Index, src: Entry) -> None:
        """Copy ``src``'s rows into rows ``dst``, in place."""
        theirs = src.tensors()
        for n, t in self.tensors().items():
            t[dst] = theirs[n]

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` over row ``dst`` in place."""
        for t in self.tensors().values():
            t[dst].copy_(t[src])

    def resize_rows(self, rows: int, live: int) -> None:
        """Reallocate to ``rows`` rows (dim 0), copying rows ``[0, live)``; the others are
        left unwritten until :meth:`write_rows` fills one whole (a slot pool growing or
        giving memory back)."""
        for name, old in self.tensors().items():
            new = old.new_empty(rows, *old.shape[1:])
            new[:live] = old[:live]
            setattr(self, name, new)

    def reserve(self, positions: int, live: int | None = None) -> None:
        """Make room for ``positions`` tokens per row (only a KV cache needs any)."""

    def reserve_like(self, src: Entry, live: int | None = None) -> None:
        """Make room to write ``src``'s rows here (only a KV cache needs any)."""

    @classmethod
    def cat(cls, entries: Sequence[Entry]) -> Entry:
        first = entries[0]
        return first._with({n: torch.cat([e.tensors()[n] for e in entries])
                            for n in first.tensors()})


@dataclass
class RecurrentEntry(Entry):
    """s ``[B, H, F, M]`` = Σ φ(k)vᵀ (decayed, for gated models) and, where the model divides
    by it, z ``[B, H, F]`` = Σ φ(k). Both fp32, constant in size."""

    s: torch.Tensor
    z: torch.Tensor | None = None
    KIND: ClassVar[str] = "recurrent"
    TENSORS: ClassVar[tuple[str, ...]] = ("s", "z")

    @classmethod
    def empty(cls, batch: int, heads: int, key_dim: int, value_dim: int,
              with_z: bool = True) -> RecurrentEntry:
        return cls(torch.zeros(batch, heads, key_dim, value_dim),
                   torch.zeros(batch, heads, key_dim) if with_z else None)


@dataclass
class ConvEntry(Entry):
    """A causal convolution's last K-1 inputs, ``window [B, K-1, C]`` fp32."""

    window: torch.Tensor
    KIND: ClassVar[str] = "conv"
    TENSORS: ClassVar[tuple[str, ...]] = ("window",)

    @classmethod
    def empty(cls, batch: int, width: int, channels: int) -> ConvEntry:
        return cls(torch.zeros(batch, max(width - 1, 0), channels))


KV_DTYPES = ("fp32", "bf16", "int8")  # what a KV cache may hold its keys and values in
QUANT_BLOCK = 32  # an int8 cache's values per scale (llama.cpp's q8_0 block)
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [..., D]`` (D a multiple of :data:`QUANT_BLOCK`) as an int8 cache's rows
    ``[..., D + D / 8]``: D int8 values, then one fp32 scale per block of 32 values in its
    4 bytes (as llama.cpp's q8_0 blocks, the scales gathered at the row's end): scale =
    max |x| / 127, value = round(x / scale), half to even (an all-zero block: scale 0,
    values 0). The native step quantizes with the same operations."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // QUANT_BLOCK, QUANT_BLOCK)
    scale = blocks.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values.reshape(x.shape), scale.contiguous().view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows ``[..., D + D / 8]`` (:func:`quantize_rows`) -> fp32 ``[..., D]``."""
    d = rows.shape[-1] * 8 // 9
    scale = rows[..., d:].contiguous().view(torch.float32)
    blocks = rows[..., :d].reshape(*rows.shape[:-1], d // QUANT_BLOCK, QUANT_BLOCK).float()
    return (blocks * scale.unsqueeze(-1)).reshape(*rows.shape[:-1], d)


@dataclass(eq=False)
class SharedKV:
    """Keys and values ``[B, H, C, D]`` that the states of one prefill path share: a long
    prompt's state after each chunk, several of which the prefix cache keeps (every 1,024
    tokens, at a branch point, at the prompt's end), each reading its first ``length``
    slots. Positions are only ever appended, so the states agree on every slot below their
    own length, and one buffer holds them all (as vLLM's prefix blocks are shared).

    Only the entry whose ``id`` is ``owner`` writes, at or past the length at which it took
    the buffer, which no other state sharing it has passed; any other copies the buffer
    before it writes (:meth:`KVEntry.own`). ``owner`` None: every state reading the buffer
    stays as it is (the prefix cache keeps them) and the one of length ``end``, the
    furthest, may hand the buffer on to a prefill that extends it."""

    k: torch.Tensor
    v: torch.Tensor
    owner: int | None
    end: int


@dataclass
class KVEntry(Entry):
    """Keys and values ``[B, H, C, D]``, written at each row's own position. C grows in
    blocks of :data:`KV_BLOCK` slots, never per step, up to ``max_context`` (as llama.cpp's
    cache and vLLM's pages grow: doubling held up to twice what was used). With
    ``window = W > 0`` it is a ring of at most W slots: position p lives in slot p mod W.

    ``dtype`` (``--kv-cache-dtype``): what k and v hold. ``fp32``; ``bf16`` (rounded to
    nearest even); ``int8``: rows of ``D + D / 8`` bytes, D values and an fp32 scale per
    block of 32 (:func:`quantize_rows`), so that every state operation sees two tensors
    whatever the dtype. Keys and values are written fp32 (:meth:`put`) and read back fp32
    (:meth:`keys`, :meth:`values`); attention runs in fp32 on what was stored."""

    k: torch.Tensor
    v: torch.Tensor
    max_context: int
    window: int = 0
    dtype: str = "fp32"
    shared: SharedKV | None = dataclasses.field(default=None, init=False, repr=False)
    KIND: ClassVar[str] = "kv"
    TENSORS: ClassVar[tuple[str, ...]] = ("k", "v")

    @property
    def truncatable(self) -> bool:
        """A full cache can forget its last positions; a ring has overwritten older ones."""
        return not self.window

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, max_context: int, window: int = 0,
              capacity: int = 0, dtype: str = "fp32") -> KVEntry:
        """An empty cache holding ``dtype`` (a model's, bound when it was built from
        ``--kv-cache-dtype``); an int8 cache whose head size is not a multiple of 32 is held
        in bf16."""
        if dtype == "int8" and head_dim % QUANT_BLOCK:
            dtype = "bf16"
        cap = min(max(capacity, 16), window or max_context)
        width = head_dim + head_dim // 8 if dtype == "int8" else head_dim
        shape = (batch, heads, cap, width)
        return cls(torch.zeros(shape, dtype=_STORAGE[dtype]),
                   torch.zeros(shape, dtype=_STORAGE[dtype]), max_context, window, dtype)

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` holds (a blob checks it)."""
        return _STORAGE[self.dtype]

    @property
    def head_dim(self) -> int:
        """D, the width of a key (an int8 row holds D + D / 8 bytes)."""
        width = self.k.shape[3]
        return width * 8 // 9 if self.dtype == "int8" else width

    def put(self, rows: Index, slots: Index, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store fp32 keys and values ``[b, H, t, D]`` at ``[rows, :, slots]`` (each slot
        index a tensor ``[b]`` or ``[t]``, or a slice), converted to the cache's dtype."""
        self.own()
        for held, x in ((self.k, k), (self.v, v)):
            if self.dtype == "int8":
                held[rows, :, slots] = quantize_rows(x)
            else:
                held[rows, :, slots] = x.to(held.dtype)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 keys or values ``[..., D]`` as this cache gives them back once stored (a
        prefill that attends to a chunk's own keys before reading them from the cache sees
        what a step would)."""
        if self.dtype == "int8":
            return dequantize_rows(quantize_rows(x))
        return x if self.dtype == "fp32" else x.to(torch.bfloat16).float()

    def read(self, name: str, rows: Index, slots: Index) -> torch.Tensor:
        """Keys (``name="k"``) or values at ``[rows, :, slots]`` as fp32 (a view of an fp32
        cache, else a converted copy)."""
        held = getattr(self, name)[rows, :, slots]
        if self.dtype == "int8":
            return dequantize_rows(held)
        return held if self.dtype == "fp32" else held.float()

    def as_dtype(self, dtype: str) -> KVEntry:
        """A copy holding ``dtype`` (what was stored, read fp32 and stored again; an int8
        cache's head size must allow it)."""
        if dtype == self.dtype:
            return cast(KVEntry, self._with({n: t.clone() for n, t in self.tensors().items()}))
        out = KVEntry.empty(self.batch_size, self.k.shape[1], self.head_dim, self.max_context,
                            self.window, self.capacity, dtype)
        out.put(slice(None), slice(0, self.capacity), self.read("k", slice(None), slice(None)),
                self.read("v", slice(None), slice(None)))
        return out

    def keys(self, rows: Index, n: int) -> torch.Tensor:
        """Keys of slots ``[0, n)`` of ``rows``, fp32 ``[b, H, n, D]``."""
        return self.read("k", rows, slice(0, n))

    def values(self, rows: Index, n: int) -> torch.Tensor:
        """Values of slots ``[0, n)`` of ``rows``, fp32 ``[b, H, n, D]``."""
        return self.read("v", rows, slice(0, n))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot of one row holds (keys, values and their scales)."""
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in self.tensors().values())

    @property
    def slot_limit(self) -> int:
        """The most slots this cache may ever hold: W for a ring, else max_context."""
        return self.window or self.max_context

    def slots_used(self, lengths: torch.Tensor) -> torch.Tensor:
        """Slots holding keys per row ``[B]``: the length, capped at W for a ring."""
        return lengths.clamp(max=self.window) if self.window else lengths

    def reserve(self, positions: int, live: int | None = None) -> None:
        """Room for ``positions`` tokens per row (doubling; amortised O(1) per token). A ring
        needs at most W slots, so it never refuses a length. ``live``: see :meth:`resize`."""
        if self.window:
            positions = min(positions, self.window)
        elif positions > self.max_context:
            raise ValueError(f"context of {positions} tokens exceeds max_context "
                             f"{self.max_context}")
        self.own()
        if positions <= self.capacity:
            return
        self.resize(min(_blocks(positions), self.slot_limit), live)

    def own(self) -> None:
        """Before writing in place: a buffer this cache shares but may not write
        (:class:`SharedKV`) is copied first, and this cache writes its copy."""
        if self.shared is not None and self.shared.owner != id(self):
            self.k, self.v = (t.clone(memory_format=torch.contiguous_format)
                              for t in (self.k, self.v))
            self.shared = None

    def disown(self) -> None:
        """This cache is about to be cut back: writing below its length again would change
        what others sharing its buffer read, so it writes a copy from now on."""
        if self.shared is not None and self.shared.owner == id(self):
            self.shared.owner = -1  # nobody's: the states on it stay, none extends it
            self.own()

    def extended(self, lengths: torch.Tensor, positions: int) -> KVEntry:
        """A cache holding this one's first ``lengths`` slots (rows of one length L) with
        room for ``positions``, to write ``[L, positions)`` in; this one is left as it is.
        It writes into this one's buffer (:class:`SharedKV`) where this cache may hand it
        on and it has room, else into a fresh one (blocks of ``positions`` slots, whose
        untouched pages cost nothing) that its own extensions will share."""
        used = int(lengths.max()) if lengths.numel() else 0
        if self.window:  # a ring overwrites its slots: nothing to share
            ring = self.select(slice(None), lengths)
            ring.reserve(positions)
            return ring
        positions = min(positions, self.max_context)  # room is a hint; reserve checks
        s = self.shared
        if (s is None or s.k.shape[2] < positions
                or not (s.owner == id(self) or (s.owner is None and s.end == used))):
            cap = min(_blocks(positions), self.slot_limit)
            k, v = (torch.zeros(*t.shape[:2], cap, t.shape[3], dtype=t.dtype)
                    for t in (self.k, self.v))
            k[:, :, :used], v[:, :, :used] = self.k[:, :, :used], self.v[:, :, :used]
            s = SharedKV(k, v, None, used)
        new = cast(KVEntry, self._with({"k": s.k, "v": s.v}))
        new.shared, s.owner = s, id(new)
        return new

    def join(self, base: KVEntry, start: int, end: int) -> None:
        """This one-row cache holds ``base``'s first ``start`` slots, then its own up to
        ``end`` (a generation after the prompt ``base`` was kept at): where ``base`` is the
        furthest state kept on a shared buffer with room, write slots ``[start, end)`` there
        and read the buffer from now on, as if this cache had extended ``base``; else keep
        its own memory."""
        s = base.shared
        if (self.window or s is None or s.owner is not None or s.end != start
                or s.k.shape[2] < end or self.dtype != base.dtype or self.batch_size != 1):
            return
        with torch.inference_mode():  # the buffer is a prefill's (an inference tensor)
            s.k[:, :, start:end] = self.k[:, :, start:end]
            s.v[:, :, start:end] = self.v[:, :, start:end]
        s.end = end
        self.k, self.v, self.shared = s.k[:, :, :end], s.v[:, :, :end], s

    def trim(self, lengths: torch.Tensor) -> None:
        """Keep only the slots the rows use (rounded up to 16), as :meth:`select` does: for
        a state that is kept (a prefix-cache entry), not grown. A cache sharing a buffer
        keeps reading it (views of its slots: no copy), and gives up writing it: the
        buffer is then the furthest kept state's to hand on (:class:`SharedKV`)."""
        cap = self._trimmed(lengths)
        s = self.shared
        if s is not None:
            if s.owner == id(self):
                s.owner, s.end = None, int(lengths.max())
            self.k, self.v = s.k[:, :, :cap], s.v[:, :, :cap]
            return
        if cap < self.capacity:
            self.resize(cap)

    def _trimmed(self, lengths: torch.Tensor) -> int:
        """The slots rows of ``lengths`` use, rounded up to 16."""
        used = int(self.slots_used(lengths).max()) if lengths.numel() else 0
        return max(min(-(-max(used, 1) // 16) * 16, self.slot_limit), used)

    def resize(self, capacity: int, live: int | None = None) -> None:
        """Reallocate to exactly ``capacity`` slots, copying. A ring only wraps once it holds
        W slots, so growing it never reorders anything.

        ``live = n`` (a slot pool) copies and zero-fills only rows ``[0, n)``; the other rows
        are left unwritten until :meth:`write_rows` fills one whole. The pool holds a row per
        possible sequence, so at 64 rows and 2,048 slots a full copy is 1 GiB: it stalled the
        batch for 2.5 s when one conversation first passed 1,024 tokens."""
        if capacity == self.capacity:
            return
        keep = min(capacity, self.capacity)
        rows = self.batch_size if live is None else live
        for name, old in self.tensors().items():
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:rows, :, :keep] = old[:rows, :, :keep]
            new[:rows, :, keep:] = 0  # masked-out slots must hold numbers, not garbage
            setattr(self, name, new)
        self.shared = None  # its own buffer now

    def reserve_like(self, src: Entry, live: int | None = None) -> None:
        assert isinstance(src, KVEntry)
        self.reserve(src.capacity, live)

    def select(self, idx: Index, lengths: torch.Tensor) -> KVEntry:
        """A copy of rows ``idx``, trimmed to the capacity they need."""
        cap = self._trimmed(lengths)
        return cast(KVEntry, self._with({n: _rows(t[:, :, :cap], idx)
                                         for n, t in self.tensors().items()}))

    def write_rows(self, dst: Index, src: Entry) -> None:
        """Copy ``src``'s rows into rows ``dst``; their slots past ``src``'s capacity are
        zeroed (they may hold anything after a live-only :meth:`resize`)."""
        assert isinstance(src, KVEntry)
        used = src.capacity
        self.reserve(used)
        theirs = src.tensors()
        for name, mine in self.tensors().items():
            mine[dst, :, :used] = theirs[name]
            mine[dst, :, used:] = 0

    @classmethod
    def cat(cls, entries: Sequence[Entry]) -> Entry:
        kvs = [e for e in entries if isinstance(e, KVEntry)]
        cap = max(e.capacity for e in kvs)
        return super().cat([e if e.capacity == cap else e._padded(cap) for e in kvs])

    def _padded(self, capacity: int) -> KVEntry:
        """A copy with ``capacity`` slots, the new ones zero (the entries it is made from,
        a prefix cache's perhaps, stay as they are)."""
        padded = cast(KVEntry, self._with(self.tensors()))
        padded.resize(capacity)  # new tensors on ``padded``: this entry's are not touched
        return padded


@dataclass
class PositionEntry(Entry):
    """``offset [B]`` int64: what the next token's rotary position adds to its index in the
    context. Zero for text; an image under M-RoPE (Qwen3.5) covers fewer positions than it
    has tokens, and the difference stays with the row. Rolling back text leaves it as it is."""

    offset: torch.Tensor
    KIND: ClassVar[str] = "position"
    TENSORS: ClassVar[tuple[str, ...]] = ("offset",)
    DTYPE: ClassVar[torch.dtype] = torch.long

    @property
    def truncatable(self) -> bool:
        return True

    @classmethod
    def empty(cls, batch: int) -> PositionEntry:
        return cls(torch.zeros(batch, dtype=torch.long))


ENTRY_TYPES: dict[str, type[Entry]] = {
    t.KIND: t for t in (RecurrentEntry, ConvEntry, KVEntry, PositionEntry)}
Layer = dict[str, Entry]


@dataclass
class State:
    """Per-layer entries (``layers[l]`` maps a name such as ``"recurrent"`` or ``"kv"`` to an
    entry) and ``lengths [B]`` int64, the tokens each row has consumed."""

    layers: list[Layer]
    lengths: torch.Tensor

    def entries(self) -> Iterator[Entry]:
        for layer in self.layers:
            yield from layer.values()

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries()) + self.lengths.numel() * 8

    @property
    def truncatable(self) -> bool:
        """Whether the state can be cut back to a prefix (every entry a KV cache)."""
        return all(e.truncatable for e in self.entries())

    def truncate(self, positions: int) -> None:
        """Cut every row back to its first ``positions`` tokens (a truncatable state)."""
        if not self.truncatable:
            raise ValueError("this state cannot be cut back to a prefix")
        for e in self.kv_entries:
            e.disown()
        self.lengths.fill_(positions)

    @property
    def grows(self) -> bool:
        """Whether it grows with the context (a KV cache that is not a ring)."""
        return any(isinstance(e, KVEntry) and not e.window for e in self.entries())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by ``"{layer}.{entry}.{tensor}"``, and ``"lengths"``."""
        out = {f"{i}.{name}.{t}": x for i, layer in enumerate(self.layers)
               for name, e in layer.items() for t, x in e.tensors().items()}
        out["lengths"] = self.lengths
        return out

    def layout(self) -> list[dict[str, dict[str, Any]]]:
        """What each layer holds: ``{name: {"kind": ..., **params}}`` (a blob's header)."""
        return [{name: {"kind": e.KIND, **e.params()} for name, e in layer.items()}
                for layer in self.layers]

    def _map(self, fn: Any, lengths: torch.Tensor) -> State:
        return State([{n: fn(e) for n, e in layer.items()} for layer in self.layers], lengths)

    def select(self, idx: Index) -> State:
        """A copy of the rows ``idx``."""
        lengths = _rows(self.lengths, idx)
        return self._map(lambda e: e.select(idx, lengths), lengths)

    def copy(self) -> State:
        return self.select(slice(None))

    def extended(self, positions: int) -> State:
        """A copy to write up to ``positions`` tokens per row in (a prefill's), leaving this
        state as it is: its KV caches share this one's buffers where they may
        (:meth:`KVEntry.extended`), so the states of one long prefill hold one copy of
        their keys; every other entry is copied."""
        lengths = self.lengths.clone()
        return self._map(lambda e: e.extended(lengths, positions) if isinstance(e, KVEntry)
                         else e.select(slice(None), lengths), lengths)

    def to(self, dtype: torch.dtype) -> State:
        """A copy with floating tensors in ``dtype`` (float64 references in tests)."""
        return self._map(lambda e: e._with({k: t.to(dtype) if t.is_floating_point() else
                                            t.clone() for k, t in e.tensors().items()}),
                         self.lengths.clone())

    def rows(self, n: int) -> State:
        """The first ``n`` rows as a view sharing this state's memory."""
        return self._map(lambda e: e.rows(n), self.lengths[:n])

    def write_rows(self, dst: Index, src: State) -> None:
        """Copy ``src``'s rows into rows ``dst`` of this (pool) state, in place."""
        for mine, theirs in zip(self.layers, src.layers, strict=True):
            for name, e in mine.items():
                e.write_rows(dst, theirs[name])
        self.lengths[dst] = src.lengths

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` over row ``dst`` in place."""
        for e in self.entries():
            e.move_row(src, dst)
        self.lengths[dst] = self.lengths[src]

    def resize_rows(self, rows: int, live: int) -> None:
        """Reallocate every entry to ``rows`` rows keeping rows ``[0, live)``
        (:meth:`Entry.resize_rows`); new rows have length 0."""
        for e in self.entries():
            e.resize_rows(rows, live)
        lengths = self.lengths.new_zeros(rows)
        lengths[:live] = self.lengths[:live]
        self.lengths = lengths

    def reserve(self, positions: int, live: int | None = None) -> None:
        """Room for ``positions`` tokens per row in every entry that needs it (KV caches);
        ``live``: only rows ``[0, live)`` hold data (a slot pool)."""
        for e in self.entries():
            e.reserve(positions, live)

    def reserve_like(self, src: State, live: int | None = None) -> None:
        """Room to write ``src``'s rows here; ``live`` as in :meth:`reserve`."""
        for mine, theirs in zip(self.layers, src.layers, strict=True):
            for name, e in mine.items():
                e.reserve_like(theirs[name], live)

    def reserve_step(self, live: int, tokens: int = 1) -> bool:
        """Room for ``tokens`` more tokens in each of the first ``live`` rows (a slot
        pool's); whether any tensor was reallocated (views of this state are then stale)."""
        kvs = self.kv_entries
        if not (live and kvs):
            return False
        before = [e.capacity for e in kvs]
        self.reserve(int(self.lengths[:live].max()) + tokens, live)
        return [e.capacity for e in kvs] != before

    def join(self, base: State) -> None:
        """This one-row state continues ``base`` (its first ``base`` length positions are
        ``base``'s): its KV caches read ``base``'s shared buffers where they may
        (:meth:`KVEntry.join`), so a prompt's kept states and the one after its reply hold
        the prompt's keys once."""
        start, end = int(base.lengths[0]), int(self.lengths[0])
        for mine, theirs in zip(self.kv_entries, base.kv_entries, strict=True):
            mine.join(theirs, start, end)

    def trim_kv(self) -> None:
        """Cut every KV cache down to the slots its rows use (:meth:`KVEntry.trim`)."""
        for e in self.kv_entries:
            e.trim(self.lengths)

    @property
    def kv_dtype(self) -> str:
        """What its KV caches hold, most of them (``--kv-cache-dtype``; a draft head's or a
        latent cache may keep fp32); "" for a state without any."""
        held = [e.dtype for e in self.kv_entries]
        return max(held, key=held.count) if held else ""

    @functools.cached_property
    def kv_entries(self) -> list[KVEntry]:
        """The KV-cache entries (the only ones that grow)."""
        return [e for e in self.entries() if isinstance(e, KVEntry)]

    def as_kv_dtypes(self, like: State) -> State:
        """This state with each KV cache in the dtype of ``like``'s at the same place (itself
        where they already agree)."""
        if all(a.dtype == b.dtype for a, b in zip(self.kv_entries, like.kv_entries, strict=True)):
            return self
        layers = [{n: e.as_dtype(cast(KVEntry, theirs[n]).dtype) if isinstance(e, KVEntry) else e
                   for n, e in layer.items()}
                  for layer, theirs in zip(self.layers, like.layers, strict=True)]
        return State(layers, self.lengths)

    @classmethod
    def cat(cls, states: Sequence[State]) -> State:
        """Concatenate states of one layout along the batch dimension."""
        first = states[0]
        layers = [{name: type(e).cat([st.layers[i][name] for st in states])
                   for name, e in layer.items()} for i, layer in enumerate(first.layers)]
        return cls(layers, torch.cat([st.lengths for st in states]))

    def unbatch(self) -> list[State]:
        """Single-row copies of every row."""
        return [self.select([i]) for i in range(self.batch_size)]

    @classmethod
    def from_tensors(cls, layout: list[dict[str, dict[str, Any]]],
                     tensors: dict[str, torch.Tensor]) -> State:
        """Rebuild from :meth:`layout` and :meth:`tensors` (no validation: see
        :mod:`linserve.model.state_blob`). Raises KeyError for a missing tensor or entry kind."""
        layers: list[Layer] = []
        for i, spec in enumerate(layout):
            layer: Layer = {}
            for name, desc in spec.items():
                params = {k: v for k, v in desc.items() if k != "kind"}
                etype = ENTRY_TYPES[desc["kind"]]
                named = {t: tensors[f"{i}.{name}.{t}"] for t in etype.TENSORS
                         if f"{i}.{name}.{t}" in tensors}
                layer[name] = etype(**named, **params)
            layers.append(layer)
        return cls(layers, tensors["lengths"])


def prefill_state(state: State | None, fresh: Callable[[], State], tokens: int,
                  room: int = 0) -> State:
    """The state a prefill of ``tokens`` more per row writes, with room for
    ``max(tokens, room)`` more (``room``: the rest of the prompt, so that the states a
    chunked prefill leaves share one buffer of keys, :class:`SharedKV`). ``fresh()`` makes
    one where ``state`` is None (its KV caches given fresh buffers, whose untouched pages
    cost nothing; nothing else copied); else ``state`` is extended and left as it is."""
    if state is not None:
        start = int(state.lengths.max())
        state = state.extended(start + max(tokens, room))
    else:
        state = fresh()
        start = int(state.lengths.max())
        layers = [{name: e.extended(state.lengths, start + max(tokens, room))
                   if isinstance(e, KVEntry) else e for name, e in layer.items()}
                  for layer in state.layers]
        state = State(layers, state.lengths)
    state.reserve(start + tokens)  # a prompt past the context is refused here
    return state
