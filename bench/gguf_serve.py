"""``python -m bench.gguf_serve``: the same GGUF file served by this server and by
llama-server (never run by CI; ``bash bench/llamacpp.sh build`` first).

For each checkpoint (a folder of :mod:`bench.families` or :mod:`bench.hf`, random weights of a
published shape) and each GGUF type: llama.cpp's converter writes the bf16 file and
``llama-quantize`` the others (``q4_0``, ``q8_0``, ``q4_k_m``, ``q6_k``, as users download
them). Both servers are then up at once on that one file (``linserve serve FILE`` as a user
starts it, ``llama-server -m FILE -t 2 --parallel 16``) and measured alternately with one
client (:mod:`bench.memory`'s): time to healthy, one stream alone, a prompt of about 2,048
tokens (``--prefill``), 16 concurrent streams, resident memory after them: the processes'
RSS summed (``after_streams_rss``), and their PSS (``after_streams_pss``), which counts a page
the two processes of ours share (torch's, mapped or inherited from the fork) once, as the
kernel and a container's memory limit do. With
``--start-rounds N`` each server is also started alone N times, alternately, and the time
to healthy is the median of those.

Writes ``bench/results/gguf_serve.json`` (each (model, type) kept until it is run again).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import llamacpp_compare as lc
from bench import memory
from bench.common import machine, read_json, save_figure, server_metrics, write_json
from bench.quant import rss_bytes

RESULTS = Path(__file__).with_name("results")
OUT = "gguf_serve"


def healthy_after(url: str, started: float, timeout: float = 900) -> float:
    """Seconds from ``started`` until ``url``'s /health answers 200."""
    while time.time() - started < timeout:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.time() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} never became healthy")


def warm_page_cache(file: Path) -> None:
    """Read ``file`` once, so that both servers start from the page cache: ours starts
    first, and otherwise read the file from disk where llama-server then found it cached
    (a start of 45 s against 14 s warm, after other files had pushed it out)."""
    with file.open("rb") as fh:
        while fh.read(1 << 24):
            pass


def one_file(file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both servers on ``file``; figures as the module docstring says."""
    port = lc.free_port()
    ours_cmd = [sys.executable, "-m", "linserve", "serve", str(file), "--port", str(port),
                "--threads", "2", *args.ours_args]
    theirs_cmd, theirs_port = lc.llama_server_cmd(file, args.streams, 2048)
    theirs_cmd += ["-t", "2", "--kv-unified"]
    out: dict[str, Any] = {"ours": {}, "llama_server": {}}
    warm_page_cache(file)
    started = time.time()
    with lc.running(ours_cmd, port, RESULTS / "gguf-ours.log") as ours_pid:
        out["ours"]["load_s"] = healthy_after(f"http://127.0.0.1:{port}", started)
        started = time.time()
        with lc.running(theirs_cmd, theirs_port, RESULTS / "gguf-llama.log") as theirs_pid:
            out["llama_server"]["load_s"] = time.time() - started
            servers = {"ours": (ours_pid, f"http://127.0.0.1:{port}"),
                       "llama_server": (theirs_pid, f"http://127.0.0.1:{theirs_port}")}
            _measure(servers, out, args)
    ours, theirs = out["ours"], out["llama_server"]
    out["ratios"] = {
        "batch1_tok_s": ours["batch1"]["output_tokens_per_s"]
        / theirs["batch1"]["output_tokens_per_s"],
        "streams_tok_s": streams_ratio(ours, theirs),
        "after_streams_rss": ours["after_streams_bytes"] / theirs["after_streams_bytes"],
        "after_streams_pss": ours["after_streams_pss_bytes"]
        / theirs["after_streams_pss_bytes"],
        "load_s": ours["load_s"] / theirs["load_s"]}
    if args.prefill:
        out["ratios"]["prefill_tok_s"] = (ours["prefill"]["prompt_tokens_per_s"]
                                          / theirs["prefill"]["prompt_tokens_per_s"])
    return out


def start_rounds(file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Each server started alone on ``file`` and timed to a healthy ``/health``,
    alternately, ``args.start_rounds`` times (one start, as in :func:`one_file`, varies by
    a second or more on a VM); the medians and their ratio."""
    import statistics

    warm_page_cache(file)
    times: dict[str, list[float]] = {"ours": [], "llama_server": []}
    for _ in range(args.start_rounds):
        port = lc.free_port()
        ours_cmd = [sys.executable, "-m", "linserve", "serve", str(file), "--port", str(port),
                    "--threads", "2", *args.ours_args]
        theirs_cmd, theirs_port = lc.llama_server_cmd(file, args.streams, 2048)
        theirs_cmd += ["-t", "2", "--kv-unified"]
        for who, cmd, at in (("ours", ours_cmd, port), ("llama_server", theirs_cmd, theirs_port)):
            started = time.time()
            with lc.running(cmd, at, RESULTS / f"gguf-start-{who}.log"):
                times[who].append(time.time() - started)
    medians = {who: statistics.median(t) for who, t in times.items()}
    return {"seconds": times, "median_s": medians,
            "ratio": medians["ours"] / medians["llama_server"]}


def engine_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where our engine's time went between two ``/metrics`` readings: its decode steps
    (count, seconds) and its prefill iterations (count, seconds). A 16-stream run's prompts
    are prefilled between steps (``--step-token-budget`` tokens an iteration), so its
    tokens/s mixes the two (BENCHMARKS.md §74)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {"steps": delta("linserve_step_seconds_count"),
            "step_s": delta("linserve_step_seconds_sum"),
            "prefills": delta("linserve_prefill_seconds_count"),
            "prefill_s": delta("linserve_prefill_seconds_sum")}


def _measure(servers: dict[str, tuple[int, str]], out: dict[str, Any],
             args: argparse.Namespace) -> None:
    for who, (_, url) in servers.items():  # alternately: batch 1, prefill, then the streams
        out[who]["batch1"] = memory._load(url, 1, 2, args.tokens)
    if args.prefill:
        for who, (_, url) in servers.items():
            out[who]["prefill"] = memory._prefill(url, args.prefill, args.prefill_requests)
    for round_ in range(args.stream_rounds):
        for who, (_, url) in servers.items():
            before = server_metrics(url) if who == "ours" else {}
            # Prompts of their own a round (the seed picks them): a prompt the server saw
            # before is served from its prompt cache (llama-server's slots keep theirs: its
            # second round of the same 16 prompts ran 2x its first).
            run = memory._load(url, args.streams, args.streams, args.tokens, seed=101 + round_)
            if who == "ours":
                run["engine"] = engine_split(before, server_metrics(url))
            out[who].setdefault("streams", run)  # the first round's whole report
            out[who].setdefault("streams_rounds", []).append(run["output_tokens_per_s"])
    time.sleep(2.0)
    for who, (pid, _) in servers.items():
        out[who]["after_streams_bytes"] = rss_bytes(pid)
        out[who]["after_streams_pss_bytes"] = memory.pss_bytes(pid)
    out["ours"]["health"] = httpx.get(servers["ours"][1] + "/health", timeout=30).json()


def streams_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """Ours ÷ theirs 16-stream tokens/s: the medians of the rounds (``--stream-rounds``),
    each server's rounds alternating with the other's."""
    import statistics

    return (statistics.median(ours["streams_rounds"])
            / statistics.median(theirs["streams_rounds"]))


def plot(result: dict[str, Any], out: str = OUT) -> None:
    """Bars of ours ÷ llama-server per measure, one group per (model, type): above 1 is
    faster (or, for memory and load time, larger)."""
    import matplotlib.pyplot as plt

    measures = ["batch1_tok_s", "streams_tok_s", "prefill_tok_s", "after_streams_rss", "load_s"]
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(runs)
    for i, (name, entry) in enumerate(runs.items()):
        values = [entry["ratios"].get(m, 0.0) for m in measures]
        ax.bar([j + i * width for j in range(len(measures))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(measures))], measures)
    ax.set_ylabel("ours ÷ llama-server (same GGUF file)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("One GGUF file, both servers (2 cores)")
    save_figure(fig, f"{out}.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path, help="Hugging Face folders")
    p.add_argument("--kinds", nargs="+", default=["q4_0", "q8_0", "q4_k_m"])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--prefill-requests", type=int, default=2)
    p.add_argument("--stream-rounds", type=int, default=1,
                   help="run the 16 streams this many times on each server, alternately, "
                   "and take each server's median (the VM's speed drifts by a fifth within "
                   "minutes: one round each gave 1.82x and 2.29x on one file, §73 and §74)")
    p.add_argument("--ours-args", nargs="*", default=[])
    p.add_argument("--start-rounds", type=int, default=0,
                   help="also start each server alone this many times, alternately, and "
                   "record the median times to healthy (load_s is then their ratio)")
    p.add_argument("--starts-only", action="store_true",
                   help="only the --start-rounds starts, into an earlier run's entry")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--out", default=OUT, help="results name (bench/results/OUT.json, .png): "
                   "one per machine, so that one plot never mixes CPUs")
    args = p.parse_args(argv)
    out = args.out
    result = read_json(out) if (RESULTS / f"{out}.json").exists() else {"runs": {}}
    if args.plot_only:
        plot(result, out)
        return
    result["machine"] = machine()
    for checkpoint in args.checkpoints:
        for kind in args.kinds:
            file = lc.gguf(checkpoint, kind)
            print(f"== {checkpoint.name} {kind}: {file}", flush=True)
            key = f"{checkpoint.name}/{kind}"
            if args.starts_only:  # the starts alone, into the entry of an earlier run
                entry = result["runs"].setdefault(key, {"ratios": {}})
                entry["starts"] = start_rounds(file, args)
                entry["ratios"]["load_s"] = entry["starts"]["ratio"]
                print(entry["starts"]["median_s"], flush=True)
                write_json(out, result)
                continue
            entry = one_file(file, args)
            if args.start_rounds:
                entry["starts"] = start_rounds(file, args)
                entry["ratios"]["load_s"] = entry["starts"]["ratio"]
            entry["command"] = " ".join(["python -m bench.gguf_serve", str(checkpoint),
                                         "--kinds", kind])
            result["runs"][key] = entry
            print({k: round(v, 3) for k, v in entry["ratios"].items()}, flush=True)
            write_json(out, result)
    plot(result, out)


if __name__ == "__main__":
    main()
