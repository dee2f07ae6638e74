"""Shared fixtures: the real weights (or a tiny random checkpoint if they are missing) and
real server processes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.serverproc import ROOT, ServerProcess
from linserve.model import modes
from linserve.model.tokenizer import Tokenizer

WEIGHTS = ROOT / "weights"

# Servers started by the tests load fp32 weights unless a test asks otherwise: the exactness
# tests compare paths (prefill against steps, cached against cold) to fp32 precision, and
# the default, --dtype auto, would pick bf16 on CPUs with native bf16. tests/server/
# test_dtype.py starts servers with the default itself.
os.environ.setdefault("LINSERVE_DTYPE", "float32")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the native kernels once, before any test starts a server: a server that
    compiles them itself spends a minute or two of its health wait doing so, and a test
    that gives up on it would kill the build halfway."""
    from linserve.model import kernels

    kernels.load()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    """A failed test's report carries the log tail of every server still running or stopped
    during the test: a flaky failure in CI can then be read from CI's own output."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    servers = [*ServerProcess.live, *ServerProcess.stopped]
    ServerProcess.stopped.clear()
    if report.failed:
        for srv in servers:
            try:
                tail = srv.logs()[-6000:]
            except OSError:
                continue
            report.sections.append((f"server log (port {srv.port}, last 6000 chars)", tail))


def _auto_dtypes() -> list[str]:
    """What ``--dtype auto`` can resolve to on this CPU: fp32 everywhere (an AVX2-only CPU's
    path), and bf16 too where the CPU has native bf16 products."""
    from linserve.model import loader

    return ["float32", "bfloat16"] if loader.pick_dtype("auto")[0] == "bfloat16" else ["float32"]


@pytest.fixture(params=_auto_dtypes())
def auto_dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The dtype ``loader.load(..., dtype="auto")`` picks in this test, each way this CPU can
    take: on a CPU with native bf16 the fp32 path is forced once (its flags read as an AVX2
    CPU's), so a test of ``auto`` checks both paths on every machine that has both."""
    from linserve.model import loader

    if request.param == "float32":
        monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset())
    assert loader.pick_dtype("auto")[0] == request.param
    return str(request.param)


def _tiny_checkpoint(path: Path, kind: str) -> Path:
    from linserve.model.architectures.own_model import LanguageModel
    from linserve.model.own_config import ModelConfig
    from tests.model.helpers import VARIANTS

    torch.manual_seed(0)
    shape: dict[str, object] = {"attention": kind, **VARIANTS.get(kind, {})}
    cfg = ModelConfig(vocab_size=8192, d_model=64, n_layers=2, n_heads=2, d_ff=128,
                      max_context=1024, **shape)  # type: ignore[arg-type]
    LanguageModel(cfg).save(path)
    shutil.copy(WEIGHTS / "tokenizer.json", path / "tokenizer.json")
    return path


def _weights(kind: str, factory: pytest.TempPathFactory) -> Path:
    """The shipped checkpoint of ``kind``, or a tiny random one if it is missing."""
    real = WEIGHTS / kind
    if (real / "model.safetensors").exists():
        return real
    return _tiny_checkpoint(factory.mktemp(f"tiny-{kind}"), kind)


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The shipped models' tokenizer (the tiny test checkpoints are made with it too)."""
    return Tokenizer.from_file(WEIGHTS / "tokenizer.json")


@pytest.fixture(scope="session")
def linear_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _weights("linear", tmp_path_factory)


@pytest.fixture(scope="session")
def softmax_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _weights("softmax", tmp_path_factory)


@pytest.fixture(scope="session")
def server(linear_weights: Path) -> Iterator[ServerProcess]:
    """One shared linear server for the integration tests that don't need special settings."""
    with ServerProcess(linear_weights, args=["--max-running", "64", "--max-waiting", "64"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def softmax_server(softmax_weights: Path) -> Iterator[ServerProcess]:
    with ServerProcess(softmax_weights) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _process_modes() -> Iterator[None]:
    """Restore the process-wide inference modes after every test: ``loader.load`` sets the
    quantization for the whole process (as the engine does once at start), and a test that
    loaded an int8 model would otherwise leave every later in-process model quantized."""

    before = modes.enabled(), modes.quantization()
    yield
    if modes.enabled() != before[0]:
        modes.set_enabled(before[0])
    modes.set_quantization(before[1])
