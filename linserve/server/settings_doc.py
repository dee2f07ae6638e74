"""``python -m linserve.server.settings_doc``: write ``docs/configuration.md`` from
:class:`~linserve.server.settings.Settings`, every flag with its ``LINSERVE_*`` variable, type,
default and description. ``tests/server/test_docs.py`` fails when the page and the code
disagree; rerun this to update it."""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from linserve.server.settings import ENV_PREFIX, PROJECT_ROOT, Settings

PAGE = PROJECT_ROOT / "docs" / "configuration.md"

HEADER = """# Configuration

Every setting of `linserve serve` is a command-line flag and an environment variable
(`LINSERVE_` and the name in capitals): `--max-running 16` and `LINSERVE_MAX_RUNNING=16` are
the same. Flags win over variables, variables over defaults; a bad value stops the server at
start with one line naming the setting. Boolean flags also have a `--no-` form
(`--no-batch-invariant`). `linserve serve MODEL` is `--model MODEL`.

This page is generated from the settings class (`python -m linserve.server.settings_doc`);
a test fails when it and the code disagree.

| flag | environment variable | type | default | what it does |
|---|---|---|---|---|
"""


def _type(field: FieldInfo) -> str:
    """The field's type as a user writes it: the choices of a Literal, else its name."""
    ann = field.annotation
    if typing.get_origin(ann) is typing.Literal:
        return " \\| ".join(f"`{a}`" if a != "" else '`""`' for a in typing.get_args(ann))
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    base = args[0] if args else ann
    return getattr(base, "__name__", str(base)).replace("Path", "path")


def _default(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The page's text."""
    rows = []
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{flag}` | `{ENV_PREFIX}{name.upper()}` | {_type(field)} | "
                    f"{_default(field.default)} | {_cell(field.description or '')} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> None:
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render())
    sys.stdout.write(f"wrote {PAGE.relative_to(PROJECT_ROOT)}\n")


if __name__ == "__main__":
    main()
