"""model.heap: freed heap goes back to the system once it has piled up (what the loader does
between packed layers), and the resident set is read as ``/proc`` gives it."""

from __future__ import annotations

import os

import pytest
import torch

from linserve.model import heap

pytestmark = pytest.mark.skipif(not heap.trim() and heap.resident_bytes() == 0,
                                reason="needs glibc's malloc_trim and procfs")


def test_resident_bytes_reads_this_process_and_others() -> None:
    assert abs(heap.resident_bytes() - heap.resident_bytes(os.getpid())) < 8 << 20
    assert heap.resident_bytes() > 50 << 20  # torch alone
    assert heap.resident_bytes(2**22 + 12345) == 0  # no such process


def test_a_trimmer_gives_back_freed_heap_once_it_has_grown() -> None:
    heap.trim()
    trimmer = heap.Trimmer(64 << 20)
    assert not trimmer()  # nothing grew
    before = heap.resident_bytes()
    pieces = [torch.ones(16 << 10) for _ in range(3200)]  # 200 MiB in 64 KiB heap chunks
    keep = torch.ones(16 << 10)  # above them: the heap's top cannot simply shrink
    del pieces
    assert heap.resident_bytes() - before > 150 << 20  # freed, but still resident
    assert trimmer()
    assert heap.resident_bytes() - before < 32 << 20
    assert not trimmer()  # nothing grew since
    del keep


_SCRATCH_FAULTS = """
import resource, sys, torch
from linserve.model import heap
if sys.argv[1] == "keep":
    assert heap.keep_scratch()
def faults() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, made and freed: a step's scratch
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(3):  # the heap settles: a few holes the aligned blocks do not fit, then reuse
    faults()
print(faults())
heap.trim()
"""


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_kept_scratch_is_reused_without_page_faults(mode: str) -> None:
    """After :func:`heap.keep_scratch` (the engine's setting), a freed 64 MiB block comes
    back from the heap already resident, once the heap has settled; by default glibc maps
    it afresh, and each of its 16,384 pages faults again (BENCHMARKS.md §47)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SCRATCH_FAULTS, mode], capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))).stdout
    faults = int(out.split()[-1])
    if mode == "keep":
        assert faults < 2 * 16384  # most blocks come back resident
    else:
        assert faults > 8 * 16000
