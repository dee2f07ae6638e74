"""Session blobs exported by the round-2 server (state format 2: stacked tensors) import into
today's per-layer state (format 3) and continue exactly as they did on that server.

The fixtures in ``tests/assets`` were written by the format-2 server (commit 715eb2b, fp32,
batch-invariant): a session after "ROMEO.\\nBut soft, what light" and one greedy turn, exported
with ``GET /v1/sessions/{id}/state``, then the greedy continuation that server gave.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ServerProcess

pytestmark = pytest.mark.integration
ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_a_format_2_blob_imports_and_continues_identically(
        kind: str, server: ServerProcess, softmax_server: ServerProcess) -> None:
    srv = server if kind == "linear" else softmax_server
    want = json.loads((ASSETS / "session_v2_continuations.json").read_text())[kind]
    blob = (ASSETS / f"session_v2_{kind}.safetensors").read_bytes()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        sess = c.post("/v1/sessions/import", content=blob,
                      headers={"content-type": "application/octet-stream"})
        assert sess.status_code == 200, sess.text
        out = c.post("/v1/completions", json={
            "prompt": want["prompt"], "session_id": sess.json()["id"],
            "max_tokens": want["max_tokens"], "temperature": 0}).json()
        assert out["choices"][0]["text"] == want["text"]
        again = c.get(f"/v1/sessions/{sess.json()['id']}/state").content  # now format 3
        header = json.loads(again[8 : 8 + int.from_bytes(again[:8], "little")])
        assert header["__metadata__"]["format_version"] == "3"
