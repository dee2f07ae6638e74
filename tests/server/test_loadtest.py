"""The load tester runs against the real server and reports consistent figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import loadtest
from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration


def test_loadtest_counts_and_percentiles(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    rep = loadtest.main(["--url", server.url, "--concurrency", "4", "--requests", "12",
                         "--max-tokens", "16", "--prompt-tokens", "32", "--ignore-eos",
                         "--output", str(out)])
    assert json.loads(out.read_text())["output_tokens"] == rep["output_tokens"]
    assert rep["completed"] == 12 and not rep["errors"]
    assert rep["output_tokens"] == 12 * 16  # from the usage chunks
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        row = rep[key]
        assert row["p50"] <= row["p90"] <= row["p99"]
    assert rep["ttft_ms"]["p50"] <= rep["e2e_ms"]["p50"]


def test_loadtest_sessions_and_duration(server: ServerProcess) -> None:
    rep = loadtest.main(["--url", server.url, "--concurrency", "2", "--duration", "2",
                         "--max-tokens", "8", "--sessions", "--request-rate", "10"])
    assert rep["completed"] >= 2 and not rep["errors"]
