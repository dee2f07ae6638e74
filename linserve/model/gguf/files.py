"""Opening GGUF files: one file or the shards of a split one, their metadata and tensors.

Each file is mapped read-only (``numpy.memmap``): a tensor's bytes are read from the page
cache when it is loaded, never copied whole beforehand. The header is parsed here rather
than by gguf-py's ``GGUFReader``, which builds an object per element of every array and took
6 s over a 150k-token vocabulary (this: a fraction of a second). A split model is
``NAME-00001-of-0000N.gguf`` … ``NAME-0000N-of-0000N.gguf``; naming any shard loads all of
them, the metadata from the first.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from linserve.model.info import CheckpointError

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class GGUFFileError(CheckpointError):
    """A file that is not a readable GGUF model (the message says why, in one line)."""


_MADV_DONTNEED = 4  # Linux
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # no C library to call: pages stay until the mapping closes
    _LIBC = None


def release_pages(raw: np.ndarray) -> None:
    """Drop the whole pages under ``raw`` (a tensor's bytes in the read-only mapping) from
    this process's resident set once it has been read: they are clean file pages, read
    again from the page cache if touched. Otherwise every page a load touched stayed
    resident while the file was open, a second copy of the weights in RSS (an LFM2-1.2B
    Q8_0 file: 1.2 GB)."""
    if _LIBC is None or raw.nbytes == 0:
        return
    start = raw.__array_interface__["data"][0]
    low = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    high = (start + raw.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if high > low:
        _LIBC.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), _MADV_DONTNEED)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; it need not exist)."""
    return str(path).endswith(".gguf")


def shards(path: Path) -> list[Path]:
    """Every file of the model ``path`` names, in order (just ``path`` unless split)."""
    hit = SPLIT.match(path.name)
    if hit is None:
        return [path]
    n = int(hit.group("n"))
    files = [path.with_name(f"{hit.group('stem')}-{i:05d}-of-{n:05d}.gguf")
             for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFFileError(f"{path}: shard {missing[0]} of {n} is missing")
    return files


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: ``shape`` in PyTorch's order (GGUF's ``ne`` reversed),
    ``qtype`` its storage type, ``raw`` its bytes as the reader maps them (for a quantized
    type: ``[rows, bytes per row]`` uint8; otherwise already the values, ``shape``-shaped)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    raw: np.ndarray
    nbytes: int


@dataclass(frozen=True)
class GGUFModel:
    """The metadata (key -> Python value) and tensors (name -> :class:`Tensor`) of a model,
    over all its shards."""

    files: tuple[Path, ...]
    meta: dict[str, Any]
    tensors: dict[str, Tensor]

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """``{arch}.{key}`` of the metadata (``default`` when absent)."""
        return self.meta.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        """``{arch}.{key}``; KeyError naming it when absent."""
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            raise KeyError(full)
        return self.meta[full]


@lru_cache(maxsize=4)
def open_model(path: Path) -> GGUFModel:
    """Read the metadata and tensor table of the model ``path`` names (cached: a loader asks
    more than once)."""
    files = shards(path)
    meta: dict[str, Any] = {}
    tensors: dict[str, Tensor] = {}
    for i, file in enumerate(files):
        try:
            kv, table = _read(file)
        except (ValueError, OSError, IndexError, struct.error, KeyError) as exc:
            raise GGUFFileError(f"{file}: not a readable GGUF file ({exc})") from None
        if i == 0:
            meta = kv
        tensors.update(table)
    return GGUFModel(tuple(files), meta, tensors)


# GGUF value types -> numpy dtypes (8: string, 9: array)
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


# Arrays of at least this many strings are read when asked for (Strings).
LAZY_STRINGS = 4096


class Strings(Sequence[str]):
    """A GGUF array of strings in the mapped file, each decoded (UTF-8, bad bytes replaced)
    when asked for: ``starts [n]`` the byte where each one's text starts (its length the
    8 bytes before), ``end`` the byte after the last."""

    def __init__(self, buf: memoryview, starts: np.ndarray, end: int) -> None:
        self.buf, self.starts, self.end = buf, starts, end

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        at = int(self.starts[i])
        (n,) = struct.unpack_from("<Q", self.buf, at - 8)
        return str(self.buf[at:at + n], "utf-8", "replace")

    def __iter__(self) -> Iterator[str]:
        buf = self.buf
        ends = [*(self.starts[1:] - 8).tolist(), self.end]  # each record's length field
        for at, end in zip(self.starts.tolist(), ends, strict=True):
            yield str(buf[at:end], "utf-8", "replace")


class _Cursor:
    """Reads GGUF's little-endian values from a byte buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def scalar(self, kind: int) -> Any:
        dtype = np.dtype(_SCALARS[kind])
        value = np.frombuffer(self.buf, dtype, 1, self.at)[0]
        self.at += dtype.itemsize
        return bool(value) if kind == 7 else value.item()

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.at)
        self.at += 8 + n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> Sequence[str]:
        """``count`` strings in a row: a list, or for many (a vocabulary's 250k tokens and
        merges) :class:`Strings`, each decoded when asked for (decoding them all took 0.4 s
        of every start, where a cached vocabulary needs only their number and the control
        tokens' names)."""
        buf, at = self.buf, self.at
        starts: list[int] = []
        length = struct.Struct("<Q").unpack_from
        append = starts.append
        for _ in range(count):  # a loop of locals: the records' lengths set where each starts
            append(at + 8)
            at += 8 + length(buf, at)[0]
        self.at = at
        strings = Strings(buf, np.array(starts, dtype=np.int64), at)
        return strings if count >= LAZY_STRINGS else list(strings)

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.scalar(kind)
        sub, count = struct.unpack_from("<IQ", self.buf, self.at)
        self.at += 12
        if sub == 8:
            return self.strings(count)
        if sub == 9:
            return [self.value(9) for _ in range(count)]
        dtype = np.dtype(_SCALARS[sub])
        values = np.frombuffer(self.buf, dtype, count, self.at)
        self.at += dtype.itemsize * count
        return [bool(v) for v in values] if sub == 7 else values.tolist()


def _read(file: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A file's metadata and tensors (each a view of the mapped file)."""
    data = np.memmap(file, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data.data))
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", cur.buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"magic {magic!r}, version {version}")
    cur.at = 24
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        (kind,) = struct.unpack_from("<I", cur.buf, cur.at)
        cur.at += 4
        meta[key] = cur.value(kind)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (dims,) = struct.unpack_from("<I", cur.buf, cur.at)
        ne = struct.unpack_from(f"<{dims}Q", cur.buf, cur.at + 4)
        kind, offset = struct.unpack_from("<IQ", cur.buf, cur.at + 4 + 8 * dims)
        cur.at += 4 + 8 * dims + 12
        infos.append((name, tuple(int(n) for n in reversed(ne)), GGMLQuantizationType(kind),
                      offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.at // align) * align
    return meta, {name: _tensor(data, start + offset, name, shape, qtype)
                  for name, shape, qtype, offset in infos}


def _tensor(data: np.ndarray, at: int, name: str, shape: tuple[int, ...],
            qtype: GGMLQuantizationType) -> Tensor:
    """The tensor at byte ``at`` of the mapped file: its values (a float type) or its
    blocks as ``[rows, bytes per row]`` uint8."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    row_bytes = shape[-1] // block * size
    raw = data[at:at + rows * row_bytes]
    floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
              GGMLQuantizationType.BF16: np.uint16}
    if qtype in floats:
        values = raw.view(floats[qtype]).reshape(shape)
        return Tensor(name, shape, qtype, values, raw.nbytes)
    return Tensor(name, shape, qtype, raw.reshape(rows, row_bytes), raw.nbytes)
