"""The kernel build's housekeeping: a lock file left by a process killed while compiling is
cleared (torch's extension builder would wait for it forever), while a live build holds
the others off; each source checkout builds in a folder of its own."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from model import kernels


def test_a_dead_builders_lock_is_removed_and_a_live_build_holds_others_off(
        tmp_path: Path) -> None:
    torch_lock = tmp_path / "lock"
    torch_lock.touch()  # what a build killed mid-compile leaves behind
    with kernels.build_lock(tmp_path):
        assert not torch_lock.exists()
        with open(tmp_path / "linserve.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second builder must wait
    with open(tmp_path / "linserve.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the build


def test_each_checkout_builds_in_a_folder_of_its_own() -> None:
    folder = kernels.default_build_dir(kernels.NAME)
    assert folder.name.startswith(kernels.NAME + "-")
    assert folder == kernels.default_build_dir(kernels.NAME)  # stable across calls
