"""Helpers shared by the benchmarks: machine description, timing, result files."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on (and how loaded the machine was)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_1m": os.getloadavg()[0],
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def time_ms(fn: Callable[[], object], min_iters: int = 5, min_seconds: float = 0.3,
            warmup: int = 2) -> float:
    """Median milliseconds per call over at least ``min_iters`` calls and ``min_seconds``."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
        if len(times) > 2000:
            break
    times.sort()
    return times[len(times) // 2]


def time_interleaved(fns: Mapping[str, Callable[[], object]], rounds: int = 7,
                     round_seconds: float = 0.05, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds per call of each function, timed in alternating rounds (a, b, c,
    a, b, c, ...) so that a slow patch of a shared machine hits every one of them alike and
    their ratios stay meaningful."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            while time.perf_counter() - start < round_seconds or len(samples[name]) < 3:
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1000)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def prefill_forms(model: Any, shapes: list[tuple[int, int]], set_form: Callable[[str], None],
                  forms: tuple[str, str], rounds: int) -> list[dict[str, Any]]:
    """A model's whole prefill in two forms of one of its layers (``set_form`` switches):
    for each (prompts, tokens) shape, random prompts prefilled once per form to warm up,
    then the forms alternated ``rounds`` times and the best wall time of each kept. A row
    per shape: both times, both tokens/s, and ``speedup`` = the first form's time over the
    second's."""
    rows: list[dict[str, Any]] = []
    for b, t in shapes:
        ids = torch.randint(0, 8000, (b, t), generator=torch.Generator().manual_seed(0))

        def once(form: str, ids: torch.Tensor = ids) -> float:
            set_form(form)
            start = time.perf_counter()
            model.prefill(ids)
            return time.perf_counter() - start

        for form in forms:
            once(form)
        best = dict.fromkeys(forms, float("inf"))
        for _ in range(rounds):
            for form in forms:
                best[form] = min(best[form], once(form))
        row: dict[str, Any] = {"prompts": b, "tokens": t}
        row.update({f"{f}_s": round(best[f], 2) for f in forms})
        row.update({f"{f}_tok_s": round(b * t / best[f], 1) for f in forms})
        row["speedup"] = round(best[forms[0]] / best[forms[1]], 2)
        rows.append(row)
    return rows


def style_axes(ax: Any, xlabel: str, ylabel: str, title: str, logy: bool = True,
               legend_size: int | None = None) -> None:
    """The common look of the benchmark plots: log2 x, optional log y, grid, legend."""
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def plot_panels(name: str, rows: list[dict[str, Any]], x: str, series: str,
                panels: list[tuple[str, str]], xlabel: str, *, logx: int = 10,
                logy: bool = False, label: Callable[[Any], str] = str) -> None:
    """One figure of side-by-side panels, one per ``(column, title)``: that column against
    ``x``, one line per value of ``series`` (named by ``label``). Saved as ``name``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for value in sorted({r[series] for r in rows}):
            pts = [r for r in rows if r[series] == value]
            ax.plot([r[x] for r in pts], [r[key] for r in pts], "o-", label=label(value))
        ax.set_xscale("log", base=logx)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, name)


def save_figure(fig: Any, name: str) -> None:
    fig.tight_layout()
    fig.savefig(RESULTS / name, dpi=110)


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/results/{name}.json`` (``name`` may already end in .json)."""
    path = RESULTS / f"{name.removesuffix('.json')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def read_json(name: str) -> dict[str, Any]:
    """``bench/results/{name}.json`` as :func:`write_json` wrote it."""
    data: dict[str, Any] = json.loads((RESULTS / f"{name.removesuffix('.json')}.json").read_text())
    return data


def saved_models(name: str) -> dict[str, Any]:
    """``bench/results/{name}.json``'s result of per-model entries (``{"models": {}}`` when
    none was written yet), to which a run adds or replaces its own models."""
    try:
        return cast(dict[str, Any], read_json(name)["result"])
    except FileNotFoundError:
        return {"models": {}}


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "-" if v is None else str(v)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (e.g. the server's engine process)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (the engine process is a child); a
    process gone meanwhile counts 0."""
    from linserve.model.heap import resident_bytes

    try:
        children = child_pids(pid)
    except OSError:
        children = []
    return resident_bytes(pid) + sum(rss_bytes(c) for c in children)


def server_metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of a server's Prometheus ``/metrics`` (histograms' ``_sum`` and
    ``_count`` included), by name; empty when it is unreachable or does not answer in
    Prometheus text (llama-server without ``--metrics``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(url + "/metrics", timeout=10)
        if r.status_code != 200:
            return {}
        return {s.name: s.value for family in text_string_to_metric_families(r.text)
                for s in family.samples if not s.labels}
    except (httpx.HTTPError, ValueError):
        return {}
