"""``python -m bench.kv_cache``: what ``--kv-cache-dtype`` costs in accuracy, on the trained
checkpoints and the held-out works (never run by CI).

For each checkpoint (``--weights``: the softmax baseline, whose every layer is attention,
and the trained Qwen3.5, whose attention layers are one in four) and each cache dtype, the
perplexity of the validation and test works read through the stateful form: windows of
``--context`` tokens, each prefilled in ``--chunk``-token chunks carrying the state, so
that every position but a chunk's own attends to keys and values read back from the cache
as stored. Also the bytes a token of context costs. Needs the corpus
(``python -m linserve.model.training.data``). Writes ``bench/results/kv_cache.json``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import machine, print_table, write_json
from linserve.model import loader
from linserve.model.training.data import DATA_DIR, load_tokens


@torch.inference_mode()
def stream_nll(model: Any, tokens: np.ndarray, context: int, chunk: int) -> tuple[float, int]:
    """Total NLL (nats) and count over windows of ``context`` tokens, each through the
    stateful form in chunks of ``chunk``."""
    total, count = 0.0, 0
    for w0 in range(0, len(tokens) - context - 1, context):
        x = torch.from_numpy(tokens[w0 : w0 + context + 1].astype(np.int64)).unsqueeze(0)
        state = None
        for c0 in range(0, context, chunk):
            logits, state = model.prefill(x[:, c0 : c0 + chunk], state, all_logits=True)
            target = x[0, c0 + 1 : c0 + 1 + chunk]
            total += F.cross_entropy(logits[0].float(), target, reduction="sum").item()
            count += target.numel()
    return total, count


def measure(weights: Path, dtypes: list[str], context: int, chunk: int, data_dir: Path
            ) -> list[dict[str, Any]]:
    splits = {s: np.asarray(load_tokens(s, data_dir)) for s in ("valid", "test")}
    rows: list[dict[str, Any]] = []
    for kv in dtypes:
        model = loader.load(weights, "float32", kv_cache_dtype=kv)
        row: dict[str, Any] = {"weights": weights.name, "kv_cache_dtype": kv,
                               "bytes_per_token": model.info.state_bytes_per_token}
        for split, tokens in splits.items():
            nll, n = stream_nll(model, tokens, context, chunk)
            row[f"{split}_ppl"] = round(math.exp(nll / n), 4)
        base = rows[0] if rows else row
        for split in splits:
            row[f"{split}_delta_pct"] = round(100 * (row[f"{split}_ppl"] /
                                                     base[f"{split}_ppl"] - 1), 3)
        rows.append(row)
        print_table(rows[-1:], list(row))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, nargs="+",
                   default=[Path("weights/softmax"), Path("weights/qwen35-mtp-45m")])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8"])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for w in args.weights
            for r in measure(w, args.dtypes, args.context, args.chunk, args.data_dir)]
    write_json("kv_cache", {"command": "python -m bench.kv_cache", "machine": machine(),
                            "context": args.context, "chunk": args.chunk, "rows": rows})


if __name__ == "__main__":
    main()
