"""Where the server's resident memory goes: the engine's parts
(:mod:`linserve.server.engine.memory`, reported by the engine through ``linserve_memory_bytes``),
the sessions the HTTP process holds, and the ``runtime``: both processes' RSS less everything named
(the interpreter, torch and its thread pools, compiled kernels, the allocator's free lists, the
tokenizer).

``/health``'s ``memory`` and the ``linserve_memory_bytes{part=…}`` gauge give the same
figures; the parts add up to ``rss.total`` by construction, and the tests check that this
total is what ``/proc`` says and that the named parts never exceed it.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import REGISTRY

from linserve.model.heap import resident_bytes
from linserve.server import metrics
from linserve.server.engine.memory import ENGINE_PARTS


def _gauge(name: str, labels: dict[str, str] | None = None) -> int:
    return int(REGISTRY.get_sample_value(name, labels or {}) or 0)


def report(engine_pid: int | None) -> dict[str, Any]:
    """The report, with the ``sessions`` and ``runtime`` gauges updated. ``engine_pid``:
    the engine process (None when the engine is a thread of this process)."""
    http = resident_bytes(os.getpid())
    engine = resident_bytes(engine_pid) if engine_pid else 0
    parts = {p: _gauge("linserve_memory_bytes", {"part": p}) for p in ENGINE_PARTS}
    parts["sessions"] = _gauge("linserve_session_bytes")
    parts["runtime"] = http + engine - sum(parts.values())
    for part in ("sessions", "runtime"):
        metrics.MEMORY.labels(part=part).set(parts[part])
    return {"parts": parts, "rss": {"http": http, "engine": engine, "total": http + engine}}


def prefix_cache_report() -> dict[str, float]:
    """What the prefix cache holds, from the engine's gauges: entries, bytes (memory
    shared by entries counted once, ``shared_bytes`` of it read by several), the budget,
    the longest prefix kept, and the share of prompt tokens it served."""
    name = "linserve_prefix_cache_"
    return {"entries": _gauge(name + "entries"), "bytes": _gauge(name + "bytes"),
            "shared_bytes": _gauge(name + "shared_bytes"),
            "budget_bytes": _gauge(name + "budget_bytes"),
            "longest_tokens": _gauge(name + "longest_tokens"),
            "hit_rate": float(REGISTRY.get_sample_value(name + "hit_rate") or 0.0)}
