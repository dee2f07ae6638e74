"""Fixtures of the server tests: a tiny Qwen3.5 checkpoint with the real Qwen tokenizer and
Qwen3.5's own template, served with its tool-call and reasoning parsers (the agent APIs'
tests share it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.serverproc import ServerProcess
from tests.model.qwen_fixtures import make_checkpoint


@pytest.fixture(scope="session")
def qwen_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Served as ``q`` with ``--reasoning-parser qwen3`` (tool calls: qwen3_xml, from the
    template)."""
    path = make_checkpoint(tmp_path_factory.mktemp("qwen-agent"), "i4-tied")
    with ServerProcess.serving(path, "--reasoning-parser", "qwen3",
                               "--served-model-name", "q") as srv:
        yield srv

