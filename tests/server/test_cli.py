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


def test_linserve_serve_runs_from_any_folder(tmp_path: Path) -> None:
    """``linserve serve weights/linear`` from another folder, outside the checkout's import
    path: it serves, on this CPU's cached build of the kernels."""
    model = str(ROOT / "weights" / "linear")
    with ServerProcess(model, env=_clean_env(), command=[LINSERVE, "serve", model],
                       cwd=tmp_path) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "ROMEO.", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_the_readme_commands_and_a_first_start_from_a_fresh_clone(tmp_path: Path) -> None:
    """The README's first block is the two commands. From a fresh clone of the committed
    tree the package installs (pip's resolver, no download), and its ``linserve serve``,
    with an empty kernel cache, says what it builds, where and how long it usually takes,
    one line as each unit finishes, and a ready line whose time counts the build; then it
    answers a completion on the shipped weights. A second start loads the cached build.
    (One test for both: every first start compiles the kernels, 160 s of CI on two AVX2
    cores.)"""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```bash") + 7: readme.index("```", readme.index("```bash") + 7)]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands == ["pip install -e . && linserve serve", "bash scripts/test.sh"]
    assert (ROOT / "scripts" / "test.sh").is_file()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)],
                   check=True, timeout=120)
    dry = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                          "--no-build-isolation", "-e", str(clone)],
                         capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(clone), "LINSERVE_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "linserve", "serve"]
    weights = clone / "weights" / "linear"
    with ServerProcess(weights, env=env, cwd=clone, ready_timeout=300, command=command) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "ROMEO.", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        logs = srv.logs()
    assert "compiling the native kernels for this CPU" in logs
    assert str(cache) in logs and "usually takes" in logs  # built for the clone, there
    assert len(re.findall(r"kernels: \[\d/\d\] ", logs)) >= 3  # each unit, then the link
    built = float(re.search(r"kernels: built in ([\d.]+) s", logs).group(1))  # type: ignore[union-attr]
    ready = float(re.search(r"ready in ([\d.]+) s", logs).group(1))  # type: ignore[union-attr]
    assert ready >= built > 0
    print(f"first start: kernels built in {built:.1f} s, ready in {ready:.1f} s")
    with ServerProcess(weights, env=env, cwd=clone, command=command) as srv:
        assert "compiling the native kernels" not in srv.logs()
        assert "native kernels: this CPU's cached build" in srv.logs()
