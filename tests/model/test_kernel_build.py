"""The kernel build's housekeeping: a live build holds the others off and a dead one's lock
goes with it; each source checkout builds in a folder of its own; an up-to-date build
compiles nothing."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from linserve.model import kernels


def test_a_live_build_holds_others_off(tmp_path: Path) -> None:
    with (kernels.build_lock(tmp_path), open(tmp_path / "linserve.flock") as other,
          pytest.raises(BlockingIOError)):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second builder must wait
    with open(tmp_path / "linserve.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the build


def test_each_checkout_builds_in_a_folder_of_its_own() -> None:
    folder = kernels.default_build_dir(kernels.NAME)
    assert folder.name.startswith(kernels.NAME + "-")
    assert folder == kernels.default_build_dir(kernels.NAME)  # stable across calls
