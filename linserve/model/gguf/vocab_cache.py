"""A GGUF file's vocabulary, built once and kept on disk.

Building a ``tokenizers`` tokenizer from ``tokenizer.ggml.*`` (:func:`vocab.build`) takes
seconds for a 250k-token vocabulary, at every start. The built tokenizer's JSON is kept
under ``cache_root()/gguf-vocab``, named by the file (path, size and modification time:
a replaced file is built again) and by the source of :mod:`.vocab` (a changed rule is too);
a later start of the same file reads it back in a fraction of the time, and with it the
tokenizer's byte table (:func:`linserve.model.tokenizer.byte_table`, another second, kept
beside it as ``.bytes``: the lengths, then the bytes). Only vocabularies
of :data:`SMALLEST` tokens or more are kept (a small one builds in a blink), and only the
:data:`KEEP` entries used last (an entry is touched when read; each new file, or a file
replaced, adds one of ~7 MB for a 250k-token vocabulary, which nothing else would remove). A
cache that cannot be read or written is passed over: the vocabulary is built as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from linserve.model import tokenizer
from linserve.model.cache_dirs import cache_root
from linserve.model.gguf import vocab

_RULES = hashlib.sha1(Path(vocab.__file__).read_bytes()
                      + Path(tokenizer.__file__).read_bytes()).hexdigest()[:12]
SMALLEST = 32_768
KEEP = 16


def cache_file(files: Sequence[Path], root: Path | None = None) -> Path:
    """The cache entry for the model in ``files`` (its shards; the vocabulary is in the
    first), under ``root`` (default: ``cache_root()/gguf-vocab``)."""
    h = hashlib.sha1(_RULES.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return (root or cache_root() / "gguf-vocab") / f"{h.hexdigest()[:20]}.json"


def load(files: Sequence[Path], meta: dict[str, Any], root: Path | None = None
         ) -> HFTokenizer:
    """The vocabulary of the model in ``files`` with metadata ``meta``: from the cache
    (under ``root``) where it holds it, else built (:func:`vocab.build`, which raises
    :class:`vocab.VocabError`) and kept there when it is large."""
    if not kept(meta):
        return vocab.build(meta)
    path = cache_file(files, root)
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception:  # absent or unreadable (tokenizers raises Exception): build it
        pass
    else:
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: kept by prune
        return tok
    tok = vocab.build(meta)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(tok.to_str(), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass
    prune(path.parent)
    return tok


def prune(directory: Path, keep: int = KEEP) -> None:
    """Remove all but the ``keep`` entries of ``directory`` used last (by modification
    time: written, or touched when read), each with its byte table."""
    try:
        entries = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns,
                         reverse=True)
    except OSError:  # (one removed meanwhile by another process: pruned next time)
        return
    for old in entries[keep:]:
        for f in (old, old.with_suffix(".bytes")):
            with contextlib.suppress(OSError):
                f.unlink()


def kept(meta: dict[str, Any]) -> bool:
    """Whether the vocabulary of metadata ``meta`` is large enough to be kept."""
    return len(meta.get("tokenizer.ggml.tokens") or ()) >= SMALLEST


def load_bytes(files: Sequence[Path], meta: dict[str, Any], root: Path | None = None
               ) -> list[bytes] | None:
    """The byte table :func:`keep_bytes` kept for the model in ``files``, or None (none
    kept, or a vocabulary too small to keep)."""
    if not kept(meta):
        return None
    try:
        data = (cache_file(files, root).with_suffix(".bytes")).read_bytes()
        count = int.from_bytes(data[:8], "little")
        ends = np.frombuffer(data, np.uint32, count, 8).cumsum().tolist()
    except (OSError, ValueError):
        return None
    start = 8 + 4 * count
    if start + (ends[-1] if ends else 0) != len(data):
        return None  # cut short: built again
    return [data[start + a:start + b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def keep_bytes(files: Sequence[Path], meta: dict[str, Any], table: list[bytes],
               root: Path | None = None) -> None:
    """Keep ``table`` (a tokenizer's bytes for each token) beside the vocabulary of the
    model in ``files`` (nothing for a small vocabulary, or if it cannot be written)."""
    if not kept(meta):
        return
    path = cache_file(files, root).with_suffix(".bytes")
    lengths = np.array([len(b) for b in table], dtype=np.uint32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(len(table).to_bytes(8, "little") + lengths.tobytes() + b"".join(table))
        tmp.replace(path)
    except OSError:
        pass
