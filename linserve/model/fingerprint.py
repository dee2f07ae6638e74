"""A checkpoint's fingerprint: what exported states and shared prefixes are marked with, so
that a state is never restored into a model other than the one that made it.

It is blake2b over each file's size, its first MiB (a safetensors header and tensor table, a
GGUF file's header and the start of its metadata) and :data:`WINDOWS` windows of
:data:`WINDOW` bytes spread evenly over the rest: 17 MB read whatever the file's size.
Checkpoints that differ in their config, their tensors' names, types or shapes, or in their
weights as fine-tuning or another quantization changes them (every tensor) differ in it. A
file edited in a few bytes between two windows would not, and a state made before the edit
would then be restored into it; nothing else depends on the fingerprint. (Hashing every
byte would cost a second of CPU for each 500 MB at every start.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

HEAD = 1 << 20
WINDOW = 1 << 16
WINDOWS = 256


def update_with_file(h: hashlib.blake2b, path: Path) -> None:
    """Feed ``h`` with ``path``'s size, its head and its evenly spaced windows (a file of at
    most ``HEAD + WINDOWS * WINDOW`` bytes: all of it)."""
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with path.open("rb") as fh:
        if size <= HEAD + WINDOWS * WINDOW:
            h.update(fh.read())
            return
        h.update(fh.read(HEAD))
        step = (size - HEAD - WINDOW) / (WINDOWS - 1)
        for i in range(WINDOWS):
            fh.seek(HEAD + int(i * step))
            h.update(fh.read(WINDOW))


def files_fingerprint(files: Iterable[Path], prefix: bytes = b"") -> str:
    """The fingerprint of ``files`` in the order given, after ``prefix`` (a config's bytes)."""
    h = hashlib.blake2b(prefix, digest_size=16)
    for f in files:
        update_with_file(h, f)
    return h.hexdigest()


def short_digest(data: bytes) -> str:
    """A short digest of a small file's bytes (a state file's: what an initial state adds to
    the fingerprint, and ``GET /v1/states`` shows)."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()
