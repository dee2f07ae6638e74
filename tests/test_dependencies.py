"""Nothing the project imports is satisfied only by a package installed by hand: every
third-party module that ``linserve/``, ``tests/`` and ``bench/`` import comes from a
distribution that ``pyproject.toml`` declares (or that a declared one requires), so a clean
clone's ``pip install -e ".[dev]"`` is all the suite needs."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.paths import ROOT

LOCAL = {"linserve", "tests", "bench", "scripts"}
# Comparison-only libraries the benchmarks import inside functions, never at module level
# (llama.cpp's converter from its source tree, other grammar engines): not dependencies.
BENCH_ONLY = {"conversion", "outlines_core", "xgrammar"}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _direct(*extras: str) -> set[str]:
    """The distributions ``pyproject.toml`` declares, with ``extras``, whose markers hold."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"],
            *(r for e in extras for r in project["optional-dependencies"][e])]
    return {_name(r) for r in reqs if "sys_platform != 'win32'" not in r
            or sys.platform != "win32"}


def _declared(*extras: str) -> set[str]:
    """The distributions declared (:func:`_direct`), and those each of them requires in
    turn (one level: what their own install brings)."""
    names = _direct(*extras)
    for name in list(names):
        for req in metadata.requires(name) or []:
            if "extra ==" not in req:
                names.add(_name(req))
    return names


def _imports(path: Path, top_level_only: bool) -> Iterator[tuple[str, int]]:
    """The top-level package of each absolute import in ``path``, with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


def _unsatisfied(folder: str, allowed: set[str], top_level_only: bool) -> list[str]:
    """Imports in ``folder`` whose distribution is not in ``allowed``."""
    owners = metadata.packages_distributions()
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for module, line in _imports(path, top_level_only):
            if module in sys.stdlib_module_names or module in LOCAL:
                continue
            dists = {_name(d) for d in owners.get(module, [])}
            if not dists & allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} ({dists or 'absent'})")
    return bad


def test_the_server_imports_only_its_runtime_dependencies() -> None:
    """``linserve`` at module level needs nothing of the dev extras (transformers is a test
    reference only); inside functions it may reach the dev tools (the training helpers)."""
    assert _unsatisfied("linserve", _declared(), top_level_only=True) == []
    assert _unsatisfied("linserve", _declared("dev"), top_level_only=False) == []


def test_the_tests_and_benchmarks_import_only_declared_packages() -> None:
    assert _unsatisfied("tests", _declared("dev"), top_level_only=False) == []
    assert _unsatisfied("bench", _declared("dev", "bench"), top_level_only=True) == []
    bench_inner = _unsatisfied("bench", _declared("dev", "bench"), top_level_only=False)
    assert [b for b in bench_inner if b.split(": ")[1].split(" ")[0] not in BENCH_ONLY] == []


def test_the_declared_packages_are_installed() -> None:
    """Every declared distribution is installed and ``pip check`` finds no broken
    requirement (a hand-installed package of another version would show here)."""
    import subprocess

    missing = []
    for name in _direct("dev", "bench"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    assert missing == []
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True,
                           text=True)
    # A shared interpreter may hold packages of its own whose pins the project's install
    # upsets: only a broken requirement of one of the project's distributions (the line's
    # first word) is ours to fix.
    ours = _declared("dev", "bench")
    broken = [line for line in check.stdout.splitlines()
              if line.split() and _name(line.split()[0]) in ours]
    if broken:
        pytest.fail("pip check: " + "\n".join(broken))
