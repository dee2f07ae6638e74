"""A state as the HTTP process holds it: the session blob's bytes (format 3,
:mod:`linserve.model.state_blob`), read and compressed without torch.

The engine turns a :class:`~linserve.model.state.State` into these bytes and back (and
validates them against the model); everything between two requests (the session store,
Redis, forks, ``previous_response_id``, named states) holds a :class:`StateBlob` and reads
only what a safetensors header says: how many rows and tokens it holds, the model that made
it, what else it carries (``extra``). :meth:`StateBlob.pack` compresses it losslessly for a
store that keeps many: each tensor byte-shuffled by its element size, then zstd (an fp32
state's sign and exponent bytes are highly redundant, its low mantissa bytes close to random).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import zstandard

from linserve.model.info import StateError

# Bytes an element takes, by safetensors dtype name.
ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
              "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1}
_LEVEL = 3  # zstd level: the best ratio per millisecond on states (1 and 6 are no better)


def read_header(data: bytes) -> tuple[dict[str, Any], int]:
    """A safetensors blob's header and where its data starts; :class:`StateError` for bytes
    that are not one."""
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
    return header, 8 + n


@dataclass(frozen=True, eq=False)
class StateBlob:
    """One state's blob (``data``, as the engine wrote it). Immutable: forks share it."""

    data: bytes

    @cached_property
    def _parsed(self) -> tuple[dict[str, Any], int]:
        return read_header(self.data)

    @property
    def meta(self) -> dict[str, str]:
        meta = self._parsed[0].get("__metadata__") or {}
        return meta if isinstance(meta, dict) else {}

    def _tensor(self, name: str) -> tuple[str, list[int], bytes]:
        desc = self._parsed[0].get(name)
        if not isinstance(desc, dict):
            raise StateError(f"state blob has no tensor {name}")
        start, end = (self._parsed[1] + int(x) for x in desc["data_offsets"])
        return str(desc["dtype"]), [int(d) for d in desc["shape"]], self.data[start:end]

    @cached_property
    def lengths(self) -> list[int]:
        """Tokens each row holds (``[B]``)."""
        dtype, shape, raw = self._tensor("lengths")
        if dtype != "I64" or len(shape) != 1:
            raise StateError("state tensor lengths is not int64 [B]")
        return [int(x) for x in np.frombuffer(raw, dtype="<i8")]

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        """Tokens the first row holds (a session's state has one row)."""
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        """Bytes its tensors hold."""
        return len(self.data) - self._parsed[1]

    @property
    def fingerprint(self) -> str:
        return str(self.meta.get("fingerprint", ""))

    def extra(self) -> dict[str, Any]:
        """What the blob carries beside the state (a session's tokens, transcript)."""
        try:
            extra = json.loads(self.meta.get("extra", "{}"))
        except json.JSONDecodeError:
            return {}
        return extra if isinstance(extra, dict) else {}

    def with_extra(self, extra: dict[str, Any]) -> StateBlob:
        """The same tensors with ``extra`` in the header (an export's tokens and transcript)."""
        header, start = self._parsed
        header = {**header, "__metadata__": {**self.meta, "extra": json.dumps(extra)}}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        return StateBlob(len(text).to_bytes(8, "little") + text + self.data[start:])

    def pack(self) -> PackedBlob:
        """Compressed losslessly (:meth:`PackedBlob.unpack` gives these bytes back)."""
        header, start = self._parsed
        cctx = zstandard.ZstdCompressor(level=_LEVEL)
        spans = sorted((int(d["data_offsets"][0]), int(d["data_offsets"][1]),
                        ITEM_BYTES.get(str(d["dtype"]), 1))
                       for name, d in header.items() if name != "__metadata__")
        parts = []
        for lo, hi, item in spans:
            item = item if (hi - lo) % item == 0 else 1
            planes = np.frombuffer(self.data, np.uint8, hi - lo, start + lo).reshape(-1, item)
            parts.append((hi - lo, item, cctx.compress(np.ascontiguousarray(planes.T).tobytes())))
        return PackedBlob(self.data[:start], tuple(parts))


@dataclass(frozen=True)
class PackedBlob:
    """A :class:`StateBlob` compressed: its header as it was, then each tensor's bytes
    (``(size, element size, zstd of the byte planes)``, in the order of the data)."""

    head: bytes
    parts: tuple[tuple[int, int, bytes], ...]

    @property
    def nbytes(self) -> int:
        """Bytes held (compressed)."""
        return len(self.head) + sum(len(p[2]) for p in self.parts)

    def unpack(self) -> StateBlob:
        dctx = zstandard.ZstdDecompressor()
        out = [self.head]
        for size, item, packed in self.parts:
            planes = np.frombuffer(dctx.decompress(packed, max_output_size=size), np.uint8)
            out.append(planes.reshape(item, -1).T.tobytes())
        return StateBlob(b"".join(out))
