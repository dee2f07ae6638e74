"""glibc's heap, returned to the system when it holds much free memory.

Packing a checkpoint frees each layer's weights as read (and the fp32 copies made while
quantizing) right after packing it. glibc keeps such frees in its heap for reuse, so without
a trim the resident size climbs by the freed bytes of every layer until the load ends (int4
on the Qwen3.5-0.8B shapes: about 43 MB a layer, BENCHMARKS.md §26). A burst of requests
leaves its scratch behind the same way. Elsewhere than glibc (musl, macOS) these are no-ops.
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
