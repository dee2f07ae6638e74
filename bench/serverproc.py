"""Start the real server (``linserve serve``) in a subprocess on a free port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A running server; ``url`` is its base URL. Use as a context manager."""

    # for test reports: servers running, and those stopped since the last report
    live: ClassVar[set[ServerProcess]] = set()
    stopped: ClassVar[list[ServerProcess]] = []

    @classmethod
    def serving(cls, model: Path | str, *flags: str, **kwargs: Any) -> ServerProcess:
        """A server of the checkpoint ``model`` (a folder, a GGUF file or a hub id) with
        ``flags``, in fp32 unless they name a ``--dtype`` (``kwargs``: as the constructor's)."""
        dtype = [] if "--dtype" in flags else ["--dtype", "float32"]
        return cls(ROOT / "weights" / "linear", args=["--model", str(model), *dtype, *flags],
                   **kwargs)

    def __init__(self, weights: Path | str, env: dict[str, str] | None = None,
                 args: list[str] | None = None, port: int | None = None,
                 ready_timeout: float = 90.0, command: list[str] | None = None,
                 cwd: Path | None = None) -> None:
        """``command``: what runs in place of ``python -m linserve serve --weights WEIGHTS``
        (the flags for host and port and ``args`` follow it), from ``cwd`` (the checkout)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"linserve-{self.port}.log"
        head = command or [sys.executable, "-m", "linserve", "serve", "--weights", str(weights)]
        cmd = [*head, "--host", "127.0.0.1", "--port", str(self.port), *(args or [])]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        ServerProcess.live.add(self)
        try:
            self.wait_healthy(ready_timeout)
        except BaseException:  # a server that never became healthy is not left running
            self.stop()
            raise

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        tail = self.log_path.read_text()[-3000:]
        raise RuntimeError(f"server not healthy in {timeout}s:\n{tail}")

    def logs(self) -> str:
        return self.log_path.read_text()

    def request_record(self, request_id: str) -> dict[str, Any] | None:
        """The server's one-line JSON record of a finished request (``status``,
        ``output_tokens``: the tokens it wrote to the client before it ended or saw the
        client hang up), or None if it has not logged one yet."""
        for line in reversed(self.logs().splitlines()):
            start = line.find('{"event": "request"')
            if start >= 0 and f'"id": "{request_id}"' in line:
                record: dict[str, Any] = json.loads(line[start:])
                return record
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self in ServerProcess.live:
            ServerProcess.live.discard(self)
            ServerProcess.stopped.append(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
