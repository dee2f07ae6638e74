"""The HTTP process runs without torch: its modules import none (checked in a fresh
interpreter), a running server's HTTP process maps no libtorch while its engine does, and
everything that touches a state from the HTTP side (sessions, their export in both
formats, import, named states, forks) works through the engine's calls."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.serverproc import ROOT, ServerProcess
from tests.model import rwkv_fixtures

SHAPE = "d128-l3"

# Every module the HTTP process may import, at start or later (a Redis store, the
# playground, images, grammars).
HTTP_MODULES = [
    "linserve.cli", "linserve.server.serve", "linserve.server.api.app",
    "linserve.server.api.images", "linserve.server.api.media",
    "linserve.server.sessions.redis_store", "linserve.server.prefix_cache.remote",
    "linserve.server.grammar.compiler", "linserve.server.playground.routes",
    "linserve.server.system.memory", "linserve.server.engine.process",
    "linserve.server.engine.prelaunch",
]


def test_the_http_side_imports_no_torch() -> None:
    code = ("import importlib, sys\n"
            f"for m in {HTTP_MODULES!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(len(bad), bad[:5])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.startswith("0 "), out.stdout + out.stderr


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def rwkv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of a tiny RWKV-7 ``.pth`` with a folder of named states (state files are
    read by the engine only)."""
    tmp = tmp_path_factory.mktemp("torch-free")
    model = rwkv_fixtures.write_pth(tmp, SHAPE)
    (tmp / "states").mkdir()
    rwkv_fixtures.write_state_file(tmp / "states" / "tuned.pth", SHAPE)
    with ServerProcess.serving(model, "--state-dir", str(tmp / "states")) as srv:
        yield srv


def test_a_running_server_keeps_torch_in_the_engine(rwkv_server: ServerProcess) -> None:
    health = httpx.get(rwkv_server.url + "/health", timeout=10).json()
    engine = health["engine"]["pid"]
    assert engine is not None and _maps_torch(engine)
    assert not _maps_torch(rwkv_server.proc.pid)


def test_states_cross_the_border_as_blobs(rwkv_server: ServerProcess) -> None:
    """A session made from a named state continues, exports as a blob and as a ``.pth``
    (both engine-checked on the way back in), imports, forks, and each copy goes on
    exactly as the original would."""
    url = rwkv_server.url
    named = httpx.get(url + "/v1/states", timeout=10).json()["data"]
    assert named, "the fixture's named states"
    sess = httpx.post(url + "/v1/sessions", json={"prompt": "Hello", "state": named[0]["id"]},
                      timeout=60).json()
    sid = sess["id"]
    blob = httpx.get(f"{url}/v1/sessions/{sid}/state", timeout=30)
    pth = httpx.get(f"{url}/v1/sessions/{sid}/state", params={"format": "pth"}, timeout=30)
    assert blob.status_code == 200 and pth.status_code == 200
    copies = [httpx.post(url + "/v1/sessions/import", content=data, timeout=30).json()["id"]
              for data in (blob.content,)]
    copies.append(httpx.post(f"{url}/v1/sessions/{sid}/fork", timeout=30).json()["id"])
    assert httpx.post(url + "/v1/sessions/import", content=pth.content,
                      timeout=30).status_code == 200
    bad = httpx.post(url + "/v1/sessions/import", content=blob.content[:-7], timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_state"

    def go(session: str) -> str:
        r = httpx.post(url + "/v1/completions", json={
            "session_id": session, "prompt": " world", "max_tokens": 8, "temperature": 0},
            timeout=60)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    want = go(sid)
    assert [go(c) for c in copies] == [want] * len(copies)


def test_a_tokenizer_crosses_as_its_source_file(tmp_path: Path) -> None:
    """The engine hands the HTTP process its tokenizer as the file it was read from (not its
    JSON), read again lazily on the other side, from what the HTTP process read ahead."""
    import pickle

    from linserve.model import tokenizer as tokenizer_module
    from linserve.model.tokenizer import Tokenizer, preread

    source = tmp_path / "tokenizer.json"
    source.write_bytes((ROOT / "weights" / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_file(source)
    data = pickle.dumps(tok)
    assert len(data) < len(source.read_bytes()) and b'"merges"' not in data
    preread(source)
    copy = pickle.loads(data)
    assert copy.source == source and copy.eos_ids == tok.eos_ids
    text = "ROMEO. But soft, what light through yonder window breaks?"
    assert copy.encode(text) == tok.encode(text)
    assert source not in tokenizer_module._AHEAD  # taken by the copy's read
    source.unlink()  # no file: its JSON crosses instead
    assert pickle.loads(pickle.dumps(tok)).encode(text) == tok.encode(text)
