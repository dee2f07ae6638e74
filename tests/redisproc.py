"""A real ``redis-server`` on a free loopback port, for the multi-replica tests."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import pytest
import redis

from bench.serverproc import free_port


class RedisProcess:
    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="redis-")
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--dir", self.dir], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        """Stop the server, keeping its data directory (a test may start it again)."""
        self.proc.terminate()
        self.proc.wait(10)

    def close(self) -> None:
        """Stop the server and delete its data directory."""
        if self.proc.poll() is None:
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
