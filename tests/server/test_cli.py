"""The ``linserve`` command as a user runs it: ``linserve serve MODEL`` from any folder, a
first start with an empty kernel cache that says what it does, ``python -m linserve``, and
an install that puts nothing of ours in site-packages under a generic name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ROOT, ServerProcess
from linserve.cli import serve_args

pytestmark = pytest.mark.integration
LINSERVE = str(Path(sys.executable).with_name("linserve"))


def _clean_env() -> dict[str, str]:
    """The environment without the checkout on the import path (as outside it)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_leading_model_is_the_model_flag() -> None:
    assert serve_args(["/m", "--port", "1"]) == ["--model", "/m", "--port", "1"]
    assert serve_args(["--weights", "w"]) == ["--weights", "w"]
    assert serve_args([]) == []


def test_version_help_and_a_wrong_command() -> None:
    out = subprocess.run([LINSERVE, "--version"], capture_output=True, text=True, check=True)
    assert re.fullmatch(r"linserve \d+\.\d+\.\d+\n", out.stdout)
    bad = subprocess.run([LINSERVE, "srve"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'srve'" in bad.stderr
    assert "serve [MODEL]" in bad.stderr
    flags = subprocess.run([sys.executable, "-m", "linserve", "serve", "--help"],
                           capture_output=True, text=True, check=True).stdout
    assert "--engine-stall-seconds" in flags and "linserve serve" in flags


def test_nothing_generic_is_installed(tmp_path: Path) -> None:
    """From outside the checkout, ``model``, ``server`` and ``bench`` find nothing of ours;
    ``linserve`` does."""
    code = ("import importlib.util as u; "
            "print([u.find_spec(m) is not None for m in ('model', 'server', 'bench', "
            "'linserve', 'linserve.server.serve')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[False, False, False, True, True]"


def test_a_first_start_builds_the_kernels_and_says_so(tmp_path: Path) -> None:
    """``linserve serve weights/linear`` from another folder with an empty kernel cache:
    the log names what it builds, where and how long it usually takes, one line as each
    unit finishes, and a ready line whose time counts the build; it then serves. A second
    start loads the cached build."""
    env = {**_clean_env(), "LINSERVE_CACHE_DIR": str(tmp_path / "cache")}
    model = str(ROOT / "weights" / "linear")
    with ServerProcess(model, env=env, command=[LINSERVE, "serve", model], cwd=tmp_path,
                       ready_timeout=300) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "ROMEO.", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        logs = srv.logs()
    assert "compiling the native kernels for this CPU" in logs
    assert str(tmp_path / "cache") in logs and "usually takes" in logs
    assert len(re.findall(r"kernels: \[\d/\d\] ", logs)) >= 3  # each unit, then the link
    built = float(re.search(r"kernels: built in ([\d.]+) s", logs).group(1))  # type: ignore[union-attr]
    ready = float(re.search(r"ready in ([\d.]+) s", logs).group(1))  # type: ignore[union-attr]
    assert ready >= built > 0
    print(f"first start: kernels built in {built:.1f} s, ready in {ready:.1f} s")
    with ServerProcess(model, env=env, command=[LINSERVE, "serve", model], cwd=tmp_path) as srv:
        assert "compiling the native kernels" not in srv.logs()
        assert "native kernels: this CPU's cached build" in srv.logs()
