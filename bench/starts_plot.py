"""``python -m bench.starts_plot BEFORE AFTER``: the medians of two ``bench.gguf_serve
--starts-only`` runs (``bench/results/BEFORE.json`` and ``AFTER.json``, each against
llama-server on the same files, alternately) side by side, as ``AFTER_vs_BEFORE.png``."""

from __future__ import annotations

import argparse

from bench.common import read_json, save_figure


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: read_json(name)["runs"] for name in (args.before, args.after)}
    files = sorted(set(runs[args.before]) & set(runs[args.after]))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    bars = [(f"ours, {args.before}", args.before, "ours"),
            (f"ours, {args.after}", args.after, "ours"),
            ("llama-server", args.after, "llama_server")]
    for i, (label, run, who) in enumerate(bars):
        values = [runs[run][f]["starts"]["median_s"][who] for f in files]
        ax.bar([x + (i - 1) * width for x in range(len(files))], values, width, label=label)
    ax.set_xticks(range(len(files)), [f.replace("/", "\n") for f in files])
    ax.set_ylabel("seconds to a healthy /health (median of 5)")
    ax.set_title("Starts, kernels cached: the HTTP process without torch")
    ax.legend(fontsize=8)
    save_figure(fig, f"{args.after}_vs_{args.before}.png")


if __name__ == "__main__":
    main()
