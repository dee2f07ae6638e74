"""glibc heap tuning for the process that holds the session store.

Idle sessions are long-lived blobs of ~270 KB allocated between short-lived buffers of the
same size (request bodies, decoded tensors, shuffle copies). glibc's default malloc raises
its mmap threshold after the first large free, so all of these land on the heap, where the
freed temporaries leave holes that the next blobs only partly reuse: 10,000 imported sessions
held 274 KB of data each but grew RSS by 315 KB each. Pinning the threshold (which also
stops its adjustment) sends every allocation above it to its own mapping, returned to the
system the moment it is freed: RSS then grows by 284 KB a session. Measured with
``python -m bench.sessions`` (BENCHMARKS.md §5).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
M_TRIM_THRESHOLD = -1
# glibc's ceiling for its dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and
# the trim threshold it sets beside it (twice that)
DYNAMIC_MMAP_MAX = 32 << 20


def trim() -> bool:
    """Return the heap's free memory to the system (glibc's ``malloc_trim``): loading and
    packing a checkpoint frees gigabytes of temporaries (the weights as read, fp32 copies
    while quantizing) that glibc otherwise keeps (int4 on the 0.8B shapes: 2.42 GB resident
    after loading, 1.30 GB after this). False where there is no ``malloc_trim``."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (0: leave malloc alone). Returns whether it
    was applied (False on a libc without ``mallopt``, e.g. musl or macOS)."""
    if nbytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("mallopt(M_MMAP_THRESHOLD) unavailable; malloc left at its defaults")
    return ok


@contextlib.contextmanager
def loading_heap(after: int = 0) -> Iterator[None]:
    """Allocations of 1 MiB and more get mappings of their own while a checkpoint loads and
    packs, so each weight freed after packing goes straight back to the system: with the
    dynamic threshold, the freed originals of weights under 32 MiB stayed in the heap until
    the end (the 0.8B shapes in int8 peaked at 2.36 GB, 1.10 GB once trimmed). After, the
    threshold is pinned at ``after`` (the process's own setting), or (0) where glibc's
    dynamic one ends up, 32 MiB with trimming past 64 MiB, so that a step's temporaries stay
    on the heap as before (see ``server.engine.process``)."""
    pinned = pin_mmap_threshold(1 << 20)
    try:
        yield
    finally:
        if pinned and after > 0:
            pin_mmap_threshold(after)
        elif pinned:
            pin_mmap_threshold(DYNAMIC_MMAP_MAX)
            _mallopt(M_TRIM_THRESHOLD, 2 * DYNAMIC_MMAP_MAX)


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).mallopt(param, ctypes.c_int(value)))
    except (OSError, AttributeError):
        return False
