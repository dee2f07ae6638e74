"""An nginx on 127.0.0.1 in front of local upstreams, with the project's affinity map (the
same file the compose and Kubernetes setups use), for the routing tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

from tests.paths import ROOT

AFFINITY_MAP = ROOT / "deploy" / "nginx" / "affinity-map.conf"

CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {dir}/access.log combined;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    include {affinity_map};
    upstream linserve {{
        {balance}
        {servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 64m;
        client_body_buffer_size 1m;
        location / {{
            proxy_pass http://linserve;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
            add_header X-Upstream $upstream_addr always;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Nginx:
    """``affinity``: hash on the conversation key; otherwise round-robin."""

    def __init__(self, upstreams: list[str], directory: Path, affinity: bool) -> None:
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        directory.mkdir(parents=True, exist_ok=True)
        conf = directory / "nginx.conf"
        conf.write_text(CONF.format(
            dir=directory, affinity_map=AFFINITY_MAP, port=self.port,
            balance="hash $linserve_conversation consistent;" if affinity else "",
            servers="\n        ".join(f"server {u};" for u in upstreams)))
        self.proc = subprocess.Popen([exe, "-c", str(conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health/live", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError((directory / "error.log").read_text())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    def __enter__(self) -> Nginx:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
