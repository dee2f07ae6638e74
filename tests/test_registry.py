"""The family registry is the one list: every family's module loads, the GGUF reader maps
exactly the architectures the registry names, and the README's table and
``docs/architecture.md`` name exactly the registered families."""

from __future__ import annotations

import re

import pytest

from linserve.model.architectures import registry
from tests.paths import ROOT


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _codes(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def _readme_rows() -> list[list[str]]:
    """The README's supported-families table, a list of cells a row."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| family | `model_type`"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


@pytest.mark.parametrize("family", registry.FAMILIES, ids=lambda f: f.name)
def test_every_family_module_provides_its_loader(family: registry.Family) -> None:
    loader = family.loader()
    for method in ("check", "load", "max_state_bytes", "params"):
        assert callable(getattr(loader, method)), (family.name, method)


def test_names_and_model_types_are_registered_once() -> None:
    names = [f.name for f in registry.FAMILIES]
    assert len(names) == len(set(names))
    types = [t for f in registry.FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    assert registry.recognise({"attention": "linear"}) is registry.OWN
    assert registry.recognise({"model_type": "lfm2"}) == registry.by_name("lfm2")
    assert registry.recognise({"model_type": "gpt2"}) is None


def test_the_gguf_reader_serves_the_registered_architectures() -> None:
    from linserve.model.gguf.archs import ARCHS

    assert set(ARCHS) == registry.gguf_archs()


def test_the_readme_table_lists_the_registry() -> None:
    rows = _readme_rows()
    served = [f for f in registry.FAMILIES if f is not registry.OWN]
    assert len(rows) == len(served)
    for fam, row in zip(served, rows, strict=True):
        assert row[0] == fam.title, row
        assert _codes(row[1]) == set(fam.model_types), row
        assert _codes(row[3]) == set(fam.gguf_archs), row
    count = {18: "eighteen", 19: "nineteen", 20: "twenty", 21: "twenty-one", 22: "twenty-two"}
    assert f"GGUF files of {count[len(served)]} families" in " ".join(
        (ROOT / "README.md").read_text().split())


def test_the_architecture_document_names_every_family_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for fam in registry.FAMILIES:
        assert f"`{fam.module}`" in text, fam.module


def test_no_document_links_outside_the_repository() -> None:
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert "../shared" not in doc.read_text(), doc
