"""``python -m bench.models weights/linear weights/softmax ...``: the shipped models side by
side, from the ``eval.json`` and ``training_summary.json`` in each weights folder (written by
``python -m linserve.model.training.evaluate DIR --output DIR/eval.json`` and
``linserve.model.training.train``).

Prints one markdown table (parameters, tokens, validation/test perplexity and bits per byte,
validation perplexity against the softmax baseline, the context-use ratio) and the length
table by position bucket, and plots both (``bench/results/models.png``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import save_figure, style_axes, write_json


def load(weights: Path) -> dict[str, Any]:
    """One model's row: its evaluation and training summary."""
    ev = json.loads((weights / "eval.json").read_text())
    summary = json.loads((weights / "training_summary.json").read_text())
    cfg = json.loads((weights / "config.json").read_text())
    return {"name": weights.name, "config": cfg, "eval": ev,
            "tokens": summary["tokens_seen"], "seq_len": summary["train_config"]["seq_len"],
            "params": summary["n_params"]}


def markdown(rows: list[dict[str, Any]], baseline: str) -> str:
    """The comparison table, perplexities against ``baseline``'s validation perplexity."""
    base = next((r for r in rows if r["name"] == baseline), None)
    lines = ["| model | params | trained on | T | valid ppl | valid bits/byte | test ppl | "
             f"valid ppl ÷ {baseline} | context-use ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ev = r["eval"]
        vs = f"{ev['valid']['ppl'] / base['eval']['valid']['ppl']:.3f}" if base else "-"
        cu = ev.get("context_use", {}).get("ratio", "-")
        lines.append(f"| {r['name']} | {r['params']:,} | {r['tokens'] / 1e6:.2f}M tokens | "
                     f"{r['seq_len']} | {ev['valid']['ppl']} | {ev['valid']['bits_per_byte']} | "
                     f"{ev['test']['ppl']} | {vs} | {cu} |")
    return "\n".join(lines)


def length_markdown(rows: list[dict[str, Any]]) -> str:
    """Perplexity by position bucket, one column per model."""
    buckets = [b["bucket"] for b in rows[0]["eval"]["length_generalisation"]]
    lines = ["| positions | " + " | ".join(r["name"] for r in rows) + " |",
             "| --- |" + " --- |" * len(rows)]
    for i, bucket in enumerate(buckets):
        cells = []
        for r in rows:
            table = r["eval"]["length_generalisation"]
            ppl = table[i]["ppl"] if i < len(table) else None
            cells.append("refused" if ppl is None else str(ppl))
        lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        table = [b for b in r["eval"]["length_generalisation"] if b["ppl"] is not None]
        ends = [int(b["bucket"].strip("[)").split(",")[1]) for b in table]
        ax1.plot(ends, [b["ppl"] for b in table], "o-", label=r["name"])
    style_axes(ax1, "position (bucket end; a point covers the bucket)", "perplexity",
               "perplexity by position, 16k-token streams", logy=False, legend_size=8)
    named = [r for r in rows if "context_use" in r["eval"]]
    ratios = [r["eval"]["context_use"]["ratio"] for r in named]
    bars = ax2.bar([r["name"] for r in named], [min(x, 1.09) for x in ratios], color="tab:blue")
    ax2.bar_label(bars, labels=[f"{x:.3f}" for x in ratios], fontsize=8)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(0.95, color="tab:green", lw=0.8, ls="--", label="goal 0.95")
    ax2.set_ylim(0.8, 1.1)
    ax2.set_title("context-use ratio: carried ÷ reset every T (below 1: the state helps)",
                  fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, "models.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", nargs="+", type=Path)
    parser.add_argument("--baseline", default="softmax")
    args = parser.parse_args(argv)
    rows = [load(w) for w in args.weights]
    print(markdown(rows, args.baseline))
    print()
    print(length_markdown(rows))
    write_json("models", {"rows": rows})
    plot(rows)


if __name__ == "__main__":
    main()
