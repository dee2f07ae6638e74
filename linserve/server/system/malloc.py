"""glibc heap tuning for the process that holds the session store (returning the heap's free
memory is :mod:`linserve.model.heap`'s).

Idle sessions are long-lived blobs of ~270 KB allocated between short-lived buffers of the
same size (request bodies, decoded tensors, shuffle copies). glibc's default malloc raises
its mmap threshold after the first large free, so all of these land on the heap, where the
freed temporaries leave holes that the next blobs only partly reuse: 10,000 imported sessions
held 274 KB of data each but grew RSS by 315 KB each. Pinning the threshold (which also
stops its adjustment) sends every allocation above it to its own mapping, returned to the
system the moment it is freed: RSS then grows by 284 KB a session. Measured with
``python -m bench.sessions``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # from glibc's malloc.h


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

