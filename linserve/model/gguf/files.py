"""Opening GGUF files: one file or the shards of a split one, their metadata and tensors.

``gguf``'s :class:`GGUFReader` maps each file read-only (``numpy.memmap``): a tensor's bytes
are read from the page cache when it is loaded, never copied whole beforehand. A split model
is ``NAME-00001-of-0000N.gguf`` … ``NAME-0000N-of-0000N.gguf``; naming any shard loads all of
them, the metadata from the first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class GGUFFileError(ValueError):
    """A file that is not a readable GGUF model (the message says why, in one line)."""


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
    several times, and a vocabulary of 150k strings takes a second to parse)."""
    files = shards(path)
    meta: dict[str, Any] = {}
    tensors: dict[str, Tensor] = {}
    for i, file in enumerate(files):
        try:
            reader = GGUFReader(str(file), "r")
        except (ValueError, OSError, IndexError) as exc:
            raise GGUFFileError(f"{file}: not a readable GGUF file ({exc})") from None
        if i == 0:
            meta = {k: _value(f) for k, f in reader.fields.items()
                    if not k.startswith("GGUF.")}
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            tensors[t.name] = Tensor(t.name, shape, GGMLQuantizationType(t.tensor_type),
                                     t.data, int(t.n_bytes))
    return GGUFModel(tuple(files), meta, tensors)


def _value(field: Any) -> Any:
    """A metadata field's Python value (a string, number, bool or list of them)."""
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError):
        return None
