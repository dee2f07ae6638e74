"""``python -m bench.kv_cache``: what ``--kv-cache-dtype`` costs in accuracy, on the trained
checkpoints and the held-out works (never run by CI).

For each checkpoint (``--weights``: the softmax baseline, whose every layer is attention,
and the trained Qwen3.5, whose attention layers are one in four) and each cache dtype, the
perplexity of the validation and test works read through the stateful form: windows of
``--context`` tokens, each prefilled in ``--chunk``-token chunks carrying the state, so
that every position but a chunk's own attends to keys and values read back from the cache
as stored. Also the bytes a token of context costs. Needs the corpus
(``python -m linserve.model.training.data``). Writes ``bench/results/kv_cache.json``.

``--step FILE --depth N``: instead, the native decode step of a GGUF file (or any
checkpoint) at position N for each dtype, in alternating rounds (a fresh process per
measurement, the cache held full to N), milliseconds a step.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
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


@torch.inference_mode()
def step_ms(path: Path, kv: str, depth: int, steps: int = 24) -> float:
    """Milliseconds of one native step at position ``depth`` over a ``kv`` cache (its first
    64 positions prefilled, the rest held as zeros: a step's cost does not depend on the
    values)."""
    model = loader.load(path, kv_cache_dtype=kv)
    logits, state = model.prefill(torch.randint(0, 1000, (1, 64)))
    state.reserve(depth + 8)
    state.lengths.fill_(depth)
    token = logits.argmax(-1)
    for _ in range(3):
        model.step(token, state)
    t0 = time.perf_counter()
    for _ in range(steps):
        model.step(token, state)
    return (time.perf_counter() - t0) / steps * 1e3


def steps_table(path: Path, dtypes: list[str], depth: int, rounds: int) -> dict[str, Any]:
    """:func:`step_ms` per dtype, each in a fresh process, alternating; the best round."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for kv in dtypes:
            code = ("from pathlib import Path; from bench.kv_cache import step_ms; "
                    f"print(step_ms(Path({str(path)!r}), {kv!r}, {depth}))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout.split()[-1]
            best[kv] = min(best.get(kv, math.inf), float(out))
            print(kv, depth, f"{float(out):.1f} ms")
    return {"file": path.name, "depth": depth, "step_ms": best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, nargs="+",
                   default=[Path("weights/softmax"), Path("weights/qwen35-mtp-45m")])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8"])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--step", type=Path, help="time the decode step of this checkpoint instead")
    p.add_argument("--depth", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.step is not None:
        write_json("kv_cache_step", {"command": "python -m bench.kv_cache --step",
                                     "machine": machine(),
                                     **steps_table(args.step, args.dtypes, args.depth,
                                                   args.rounds)})
        return
    rows = [r for w in args.weights
            for r in measure(w, args.dtypes, args.context, args.chunk, args.data_dir)]
    write_json("kv_cache", {"command": "python -m bench.kv_cache", "machine": machine(),
                            "context": args.context, "chunk": args.chunk, "rows": rows})


if __name__ == "__main__":
    main()
