"""Lossless compression of idle states, for session stores that keep many of them.

Every tensor is byte-shuffled (all first bytes of its elements, then all second bytes, ...)
and compressed with zstd. An fp32 state's sign/exponent bytes are highly redundant while its
low mantissa bytes are close to random, so a real 2,000-token state of the shipped model packs
to about 90% of its size; the numbers come back bit for bit. Packing 300 KB takes well under
a millisecond, and zstd releases the GIL while it works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from linserve.model.state import State

_LEVEL = 3  # zstd level: measured the best ratio per millisecond on states (1 and 6 are no better)


@dataclass(frozen=True)
class PackedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class PackedState:
    """An immutable compressed state: safe to share between sessions (forks)."""

    layout: str  # State.layout() as JSON: per layer, each entry's kind and parameters
    tensors: tuple[PackedTensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes held (compressed)."""
        return sum(len(t.data) for t in self.tensors)


def _pack_tensor(name: str, t: torch.Tensor, cctx: zstandard.ZstdCompressor) -> PackedTensor:
    t = t.detach().contiguous()
    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()  # numpy has no bf16
    planes = arr.reshape(-1).view(np.uint8).reshape(-1, arr.itemsize).T  # [itemsize, numel]
    return PackedTensor(name, t.dtype, tuple(t.shape),
                        cctx.compress(np.ascontiguousarray(planes).tobytes()))


def _unpack_tensor(p: PackedTensor, dctx: zstandard.ZstdDecompressor) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=p.dtype).element_size()
    numel = int(np.prod(p.shape, dtype=np.int64))
    raw = dctx.decompress(p.data, max_output_size=numel * itemsize)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, numel)
    flat = planes.T.copy().reshape(-1)  # a writable copy, in element order
    return torch.from_numpy(flat.view(np.uint8)).view(p.dtype).reshape(p.shape)


def pack_state(state: State) -> PackedState:
    """Compress ``state`` (any batch size) losslessly."""
    cctx = zstandard.ZstdCompressor(level=_LEVEL)
    tensors = tuple(_pack_tensor(n, t, cctx) for n, t in state.tensors().items())
    return PackedState(json.dumps(state.layout()), tensors)


def unpack_state(packed: PackedState) -> State:
    """A fresh state, bit-identical to the one that was packed."""
    dctx = zstandard.ZstdDecompressor()
    tensors = {p.name: _unpack_tensor(p, dctx) for p in packed.tensors}
    return State.from_tensors(json.loads(packed.layout), tensors)
