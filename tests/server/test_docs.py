"""The documentation cannot drift: the configuration page is the settings class's, and every
relative link in README.md, BENCHMARKS.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from linserve.server import settings_doc
from tests.paths import ROOT

PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "bench-log").glob("*.md")), ROOT / "deploy" / "README.md"]
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


def test_benchmarks_holds_todays_results_and_the_log_its_history() -> None:
    """BENCHMARKS.md stays short (today's results and an index); every § it indexes is a
    heading of one ``docs/bench-log/`` page."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 400
    log = "\n".join(p.read_text() for p in (ROOT / "docs" / "bench-log").glob("*.md"))
    for n in re.findall(r"^\| §(\d+) \|", text, flags=re.M):
        assert f"\n## §{n}. " in log, n
