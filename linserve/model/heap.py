"""glibc's heap: returned to the system when it holds much free memory, kept while serving.

Packing a checkpoint frees each layer's weights as read (and the fp32 copies made while
quantizing) right after packing it. glibc keeps such frees in its heap for reuse, so without
a trim the resident size climbs by the freed bytes of every layer until the load ends (int4
on the Qwen3.5-0.8B shapes: about 43 MB a layer). A burst of requests
leaves its scratch behind the same way. Elsewhere than glibc (musl, macOS) these are no-ops.

While serving, the opposite: a step's scratch should come back from the heap warm. glibc
maps each block above its mmap threshold (at most 32 MB) afresh and unmaps it on free, so
every page of it faults and is zeroed again at its next use: a 512-token prefill of
LFM2-1.2B took ~250,000 page faults (1 GB), and a 512 x 16384 int4 product 20% longer
than from the heap. :func:`keep_scratch` turns that off for the engine
once the weights are in; the engine trims when a burst of requests ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def trim() -> bool:
    """Return the heap's free memory to the system (glibc's ``malloc_trim``). False where
    there is no ``malloc_trim``."""
    libc = _libc()
    try:
        return bool(libc.malloc_trim(0)) if libc is not None else False
    except AttributeError:
        return False


# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Free bytes the heap's top may hold before free() gives them back by itself (mallopt takes
# an int): the engine's idle trim returns them sooner.
KEEP_SCRATCH_BYTES = 1 << 30


def keep_scratch(limit: int = KEEP_SCRATCH_BYTES) -> bool:
    """From now on, serve every allocation from the heap (no fresh mappings, ``M_MMAP_MAX``
    0) and keep up to ``limit`` freed bytes at its top (``M_TRIM_THRESHOLD``), so that
    scratch of any size is reused without page faults until :func:`trim`. False where
    there is no ``mallopt``."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, limit))
    except AttributeError:
        return False


def resident_bytes(pid: int | None = None) -> int:
    """Resident bytes of process ``pid`` (this one by default), from its ``VmRSS``; 0 if it
    is gone or there is no procfs."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            status = f.read()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Trimmer:
    """Calls :func:`trim` each time the resident set has grown by more than ``every`` since
    the last trim, so that freed-but-kept heap never exceeds about ``every``. Cheap enough to
    ask after every packed layer, where trimming each time would re-fault the next layer's
    pages (every layer: load 26.5 → 32.4 s on the 0.8B shapes). The heap's own count of
    free bytes cannot tell: a trimmed page still counts as free, and when malloc hands it
    out again and it is freed again, it is resident once more with no change in that count.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.base = resident_bytes()

    def __call__(self) -> bool:
        """Trim if the resident set grew past ``every``; returns whether it trimmed."""
        if resident_bytes() - self.base <= self.every:
            return False
        trim()
        self.base = resident_bytes()
        return True
