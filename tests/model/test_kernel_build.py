"""The kernel build's housekeeping: a lock left by a process killed while compiling is
cleared (torch's extension builder would wait for it forever), a live one is kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

from model import kernels


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    kernels.clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running now
    old = time.time() - kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    kernels.clear_stale_lock(tmp_path)
    assert not lock.exists()
    kernels.clear_stale_lock(tmp_path / "missing")  # no folder, no lock: nothing to do
