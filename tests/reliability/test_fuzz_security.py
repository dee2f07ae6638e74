"""Schema-based fuzzing with schemathesis, hostile state blobs, and security properties."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load

from bench.serverproc import ROOT, ServerProcess
from tests.reliability.helpers import duration

pytestmark = pytest.mark.integration


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the full run fuzzes for 10 minutes
def test_schemathesis_default_checks(linear_weights: Path) -> None:
    """Every default schemathesis check (status codes, content types, schema conformance of
    JSON and SSE responses, no 5xx) over every operation, bounded by time."""
    beside = Path(sys.executable).with_name("schemathesis")  # this interpreter's, activated
    exe = str(beside) if beside.exists() else shutil.which("schemathesis")  # or not
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    seconds = int(duration(45, 600))
    with ServerProcess(linear_weights, args=["--max-tokens-limit", "64"]) as srv:
        proc = subprocess.run(
            [exe, "run", f"{srv.url}/openapi.json", "--max-time", str(seconds), "--seed", "7",
             "-n", "40", "--no-color"], cwd=ROOT, capture_output=True, text=True,
            timeout=seconds + 240, env={**os.environ, "PYTHONPATH": str(ROOT),
                                        "SCHEMATHESIS_HOOKS": "tests.reliability.st_hooks"})
        tail = proc.stdout[-3000:]
        assert proc.returncode == 0, failure_summary(proc.stdout) or tail
        assert "Traceback" not in srv.logs()
    print(tail[-400:])


def failure_summary(report: str) -> str:
    """The failing cases of a schemathesis report: operation, check, status and the first
    line of the response (the reproducing bodies can be megabytes)."""
    keep = re.compile(r"^(_+ \S+ \S+ _+|\d+\. Test Case ID|\s*- ST\d+|\s*\[\d{3}\]|\s*`)")
    start = report.find("=== FAILURES")
    lines = report[start:].splitlines() if start >= 0 else []
    summary = [line[:300] for line in lines if keep.match(line.strip())]
    errors = report.find("=== ERRORS")
    if errors >= 0:
        summary += [line[:300] for line in report[errors:].splitlines()[:40]]
    return "\n".join(summary)


def blob_metadata(blob: bytes) -> dict[str, str]:
    n = struct.unpack("<Q", blob[:8])[0]
    return dict(json.loads(blob[8 : 8 + n])["__metadata__"])


def crafted_state(meta: dict[str, str], tensors: dict[str, tuple[str, list[int]]],
                  data_len: int | None = None) -> bytes:
    """A well-formed safetensors blob with the server's own metadata (valid fingerprint, so
    it reaches the shape, dtype and size checks) and the given tensor headers."""
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = 4 if dtype in ("F32", "I32") else 8
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    body = b"\0" * (offset if data_len is None else data_len)
    return struct.pack("<Q", len(raw)) + raw + body


def hostile_blobs(good: bytes, shapes: dict[str, list[int]]) -> list[bytes]:
    """Blobs that pass the fingerprint check and break one rule each."""
    meta = blob_metadata(good)
    ok = {name: ("F32", shape) for name, shape in shapes.items()}
    out = []
    for name, shape in shapes.items():
        out.append(crafted_state(meta, {**ok, name: ("F64", shape)}))  # wrong dtype
        out.append(crafted_state(meta, {**ok, name: ("F32", [*shape[:-1], shape[-1] + 1])}))
        out.append(crafted_state(meta, {**ok, name: ("F32", [shape[0], 2, *shape[2:]])}))
    out.append(crafted_state(meta, {k: v for k, v in list(ok.items())[1:]}))  # a tensor short
    out.append(crafted_state(meta, {**ok, "extra": ("F32", [4])}))  # a tensor too many
    out.append(crafted_state(meta, ok, data_len=16))  # declared sizes beyond the data
    huge = next(iter(shapes))
    out.append(crafted_state(meta, {**ok, huge: ("F32", [2**31, 2**31])}, data_len=16))
    nan = crafted_state(meta, ok)
    out.append(nan[: -4] + struct.pack("<f", float("nan")))  # a NaN in the state
    return out


def test_hostile_state_blobs_are_rejected(server: ServerProcess) -> None:
    """Random, truncated and crafted blobs (huge declared shapes, pickles) all get 400."""
    sess = httpx.post(server.url + "/v1/sessions", json={"prompt": "Hello there"}).json()
    good = httpx.get(f"{server.url}/v1/sessions/{sess['id']}/state").content
    rng = random.Random(0)
    blobs = [os.urandom(rng.randint(0, 4096)) for _ in range(40)]
    blobs += [good[: rng.randint(0, len(good) - 1)] for _ in range(40)]
    flipped = bytearray(good)
    flipped[20] ^= 0xFF
    shapes = {name: list(t.shape) for name, t in load(good).items()}
    crafted = hostile_blobs(good, shapes)
    blobs += [bytes(flipped), *crafted,
              b"\x80\x04\x95" + os.urandom(200),  # a pickle header: never unpickled
              good + b"trailing"]
    for blob in blobs:
        r = httpx.post(server.url + "/v1/sessions/import", content=blob)
        assert r.status_code in (400, 413), (r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"
        if blob in crafted and r.status_code == 400:  # got past the fingerprint check
            assert "fingerprint" not in r.json()["error"]["message"], r.text
    ok = httpx.post(server.url + "/v1/sessions/import", content=good)
    assert ok.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_session_ids_are_unguessable(server: ServerProcess) -> None:
    ids = [httpx.post(server.url + "/v1/sessions", json={}).json()["id"] for _ in range(20)]
    assert len(set(ids)) == 20
    assert all(len(i) >= len("sess_") + 32 for i in ids)  # 192 random bits, base64url
    r = httpx.get(server.url + "/v1/sessions")
    assert r.status_code == 405  # no listing endpoint to enumerate


def test_limits_on_headers_and_bodies(server: ServerProcess) -> None:
    big = "x" * (33 << 20)  # past the default 32 MiB body
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    for head in (b"X-Big: " + b"y" * (1 << 20) + b"\r\n", b"Content-Length: abc\r\n"):
        answer = raw_request(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             + head + b"\r\n{}")
        assert answer == b"" or answer.split(b" ")[1] in (b"400", b"413", b"431"), answer[:80]
    assert httpx.get(server.url + "/health").status_code == 200


def raw_request(port: int, data: bytes) -> bytes:
    """Send raw bytes; return the response (b"" if the server just closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
            return s.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_errors_never_leak_internals(server: ServerProcess) -> None:
    probes = [("POST", "/v1/completions", b"\x00\x01"), ("POST", "/v1/sessions/import", b"{"),
              ("GET", "/v1/sessions/../../etc/passwd", None), ("POST", "/tokenize", b"[]"),
              ("DELETE", "/v1/completions", None)]
    for method, path, body in probes:
        r = httpx.request(method, server.url + path, content=body,
                          headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, r.status_code)
        assert "Traceback" not in r.text and str(ROOT) not in r.text
        assert sys.prefix not in r.text
