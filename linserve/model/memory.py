"""What memory this process may use (the startup check of weights against it, and the
default ``--max-memory``)."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int:
    """Bytes this process may still use: the cgroup limit, else MemAvailable."""
    for limit_file in ("/sys/fs/cgroup/memory.max",
                       "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
            if text.isdigit() and int(text) < 1 << 60:
                return int(text)
        except OSError:
            pass
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62
