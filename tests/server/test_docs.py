"""The documentation cannot drift: the configuration page is the settings class's, and every
relative link in README.md, BENCHMARKS.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from linserve.server import settings_doc

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_configuration_page_is_the_settings_class() -> None:
    assert settings_doc.PAGE.read_text() == settings_doc.render(), (
        "docs/configuration.md is out of date: run python -m linserve.server.settings_doc")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing = not dest.exists()
        if missing or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            bad.append(target)
    assert not bad, f"{page.name}: links that do not resolve: {bad}"


def test_the_readme_commands_run_from_a_fresh_clone(tmp_path: Path) -> None:
    """The README's first block is the two commands; from a fresh clone of the committed
    tree the package installs (pip's resolver, no download) and ``linserve serve`` answers
    a completion on the shipped weights."""
    import os
    import subprocess
    import sys

    import httpx

    from bench.serverproc import ServerProcess

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
    env = {**os.environ, "PYTHONPATH": str(clone), "LINSERVE_CACHE_DIR": str(tmp_path / "k")}
    with ServerProcess(clone / "weights" / "linear", env=env, cwd=clone, ready_timeout=300,
                       command=[sys.executable, "-m", "linserve", "serve"]) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "ROMEO.", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert str(tmp_path / "k") in srv.logs()  # its kernels built for the clone
