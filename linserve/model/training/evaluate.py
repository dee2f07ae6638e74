"""Evaluate a checkpoint: ``python -m linserve.model.training.evaluate weights/linear``.

Reports validation and test perplexity and bits per byte (non-overlapping windows of the
training context, each from an empty state, so every model is scored the same way), and a
length-generalisation table: held-out works fed as long streams through the stateful form,
perplexity by position bucket. The softmax baseline stops at its maximum context (the server
refuses longer sessions), so its buckets past that are reported as refused.

The context-use ratio asks whether the state helps: perplexity with the state carried through
4k-token streams against the state reset every T tokens (T = the training context), on the
same positions (≥ T). Below 1, what the model read long ago still helps it predict.
``--as-window T`` scores the full softmax model through a sliding window of T tokens: the
ratio of a model that always sees the last T tokens exactly, a ceiling for the others.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from linserve.model import modes
from linserve.model.architectures.own_model import LanguageModel, load_model
from linserve.model.tokenizer import Tokenizer
from linserve.model.training.data import DATA_DIR, load_tokens


@torch.inference_mode()
def windowed_nll(model: LanguageModel, tokens: np.ndarray, window: int,
                 batch: int = 16) -> tuple[float, int]:
    """Total NLL (nats) and token count over non-overlapping windows of ``window`` tokens."""
    n_win = (len(tokens) - 1) // window
    total, count = 0.0, 0
    for i in range(0, n_win, batch):
        rows = [torch.from_numpy(tokens[j * window : j * window + window + 1].astype(np.int64))
                for j in range(i, min(i + batch, n_win))]
        x = torch.stack(rows)
        logits = model(x[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total, count


@torch.inference_mode()
def stream_nll(model: LanguageModel, tokens: np.ndarray, chunk: int = 512) -> np.ndarray:
    """Per-position NLL ``[N-1]`` of one long stream through the stateful form (prefill in
    chunks carrying the state, which equals stepping token by token). The full softmax
    baseline stops at ``max_context`` positions."""
    cap = model.cfg.context_limit  # positions held; the last token is only a target
    limit = len(tokens) if cap is None else min(len(tokens), cap + 1)
    x = torch.from_numpy(tokens[:limit].astype(np.int64)).unsqueeze(0)
    state = model.new_state(1)
    out = []
    for start in range(0, limit - 1, chunk):
        piece = x[:, start : min(start + chunk, limit - 1)]
        logits, state = model.prefill(piece, state, all_logits=True)
        target = x[0, start + 1 : start + 1 + piece.shape[1]]
        out.append(F.cross_entropy(logits[0], target, reduction="none").numpy())
    return np.concatenate(out)


SLICE_TEXT = Path(__file__).resolve().parents[3] / "weights" / "test_slice.txt"


@torch.inference_mode()
def slice_perplexity(weights: Path, slice_path: Path = SLICE_TEXT) -> float:
    """Perplexity on the first 1,024 predictions of a fixed slice of the test split (shipped
    in ``weights/test_slice.txt``), so a test can catch broken loading or a changed
    tokenizer without the corpus."""
    model = load_model(weights)
    tok = Tokenizer.from_file(weights / model.cfg.tokenizer)
    x = torch.tensor([tok.encode(slice_path.read_text())[:1025]])
    logits = model(x[:, :-1])
    return math.exp(F.cross_entropy(logits[0], x[0, 1:]).item())


def buckets(train_ctx: int, length: int) -> list[tuple[int, int]]:
    """[0,T), [T,2T), [2T,4T), [4T,8T), ... up to ``length``."""
    edges = [0, train_ctx]
    while edges[-1] * 2 <= length:
        edges.append(edges[-1] * 2)
    return list(itertools.pairwise(edges))


def length_table(model: LanguageModel, streams: list[np.ndarray], train_ctx: int
                 ) -> list[dict[str, Any]]:
    """Perplexity per position bucket, averaged over several held-out streams."""
    length = min(len(s) for s in streams)
    nll = np.stack([np.pad(stream_nll(model, s[:length]), (0, 0)) for s in streams])
    rows: list[dict[str, Any]] = []
    for lo, hi in buckets(train_ctx, length - 1):
        if lo >= nll.shape[1]:
            rows.append({"bucket": f"[{lo}, {hi})", "ppl": None,
                         "note": "refused: over max_context"})
            continue
        rows.append({"bucket": f"[{lo}, {hi})", "ppl": round(math.exp(nll[:, lo:hi].mean()), 3)})
    return rows


@torch.inference_mode()
def context_use(model: LanguageModel, streams: list[np.ndarray], train_ctx: int
                ) -> dict[str, Any]:
    """Perplexity on positions ≥ T of each stream, carried (one state through the stream)
    against reset (a fresh state every T tokens); ``ratio`` = carried / reset."""
    carried, reset = [], []
    for stream in streams:
        nll = stream_nll(model, stream)
        n_win = len(nll) // train_ctx
        x = torch.from_numpy(stream[: n_win * train_ctx + 1].astype(np.int64))
        windows = torch.stack([x[i * train_ctx : (i + 1) * train_ctx + 1] for i in range(n_win)])
        logits = model(windows[:, :-1])
        fresh = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
        carried.append(nll[train_ctx : n_win * train_ctx])
        reset.append(fresh.numpy()[train_ctx:])
    ppl_carried = math.exp(float(np.concatenate(carried).mean()))
    ppl_reset = math.exp(float(np.concatenate(reset).mean()))
    return {"streams": len(streams), "stream_tokens": len(streams[0]) if streams else 0,
            "positions_from": train_ctx, "ppl_carried": round(ppl_carried, 3),
            "ppl_reset": round(ppl_reset, 3), "ratio": round(ppl_carried / ppl_reset, 4)}


def split_streams(tokens: np.ndarray, length: int, count: int) -> list[np.ndarray]:
    """Up to ``count`` non-overlapping streams of ``length + 1`` tokens."""
    n = min(count, len(tokens) // (length + 1))
    return [tokens[i * (length + 1) : (i + 1) * (length + 1)] for i in range(n)]


def training_context(weights: Path, default: int = 256) -> int:
    """The context a model was trained at, from its ``training_summary.json``."""
    try:
        summary = json.loads((weights / "training_summary.json").read_text())
        return int(summary["train_config"]["seq_len"])
    except (OSError, KeyError, ValueError, TypeError):
        return default


def evaluate(weights: Path, data_dir: Path = DATA_DIR, train_ctx: int = 256,
             stream_len: int = 16384, n_streams: int = 8,
             dtype: torch.dtype = torch.float32, window: int | None = None) -> dict[str, Any]:
    """Every figure of the module docstring for one model; ``window`` scores a softmax model
    as a sliding-window one (see :func:`linserve.model.architectures.own_model.load_model`)."""
    model = load_model(weights, dtype, window=window)
    tok = Tokenizer.from_file(weights / model.cfg.tokenizer)
    result: dict[str, Any] = {"weights": str(weights), "attention": model.cfg.kind,
                              "n_params": model.n_params(), "train_context": train_ctx}
    for split in ("valid", "test"):
        tokens = np.asarray(load_tokens(split, data_dir))
        nll, count = windowed_nll(model, tokens, train_ctx)
        n_bytes = len(tok.decode(tokens[: (len(tokens) - 1) // train_ctx * train_ctx + 1]
                                 .tolist()[1:]).encode())
        result[split] = {"ppl": round(math.exp(nll / count), 3), "tokens": count,
                         "bits_per_byte": round(nll / math.log(2) / n_bytes, 4)}
    test = np.asarray(load_tokens("test", data_dir))
    result["context_use"] = context_use(model, split_streams(test, 4096, 16), train_ctx)
    if n_streams == 0:
        return result
    held = np.concatenate([np.asarray(load_tokens(s, data_dir)) for s in ("valid", "test")])
    step = max(1, (len(held) - stream_len) // max(1, n_streams - 1))
    streams = [held[i * step : i * step + stream_len + 1] for i in range(n_streams)
               if i * step + stream_len + 1 <= len(held)]
    result["length_generalisation"] = length_table(model, streams, train_ctx)
    result["n_streams"] = len(streams)
    return result


def quantization_table(weights: Path, kinds: list[str], data_dir: Path = DATA_DIR,
                       train_ctx: int = 256, dtype: torch.dtype = torch.float32
                       ) -> dict[str, Any]:
    """Validation and test perplexity of the model at ``weights`` with its GEMM weights kept
    (``none``) and quantized to each of ``kinds`` (:mod:`linserve.model.quantize`), each from the
    same loaded weights; ``delta`` is the change against ``none`` in percent."""
    model = load_model(weights, dtype)
    splits = {s: np.asarray(load_tokens(s, data_dir)) for s in ("valid", "test")}
    rows: dict[str, Any] = {}
    try:
        for mode in ["none", *[m for m in kinds if m != "none"]]:
            modes.set_quantization(mode)
            row = {}
            for split, tokens in splits.items():
                nll, count = windowed_nll(model, tokens, train_ctx)
                row[split] = round(math.exp(nll / count), 3)
            rows[mode] = row
    finally:
        modes.set_quantization("none")
    for row in rows.values():
        row["delta_valid_pct"] = round(100 * (row["valid"] / rows["none"]["valid"] - 1), 2)
        row["delta_test_pct"] = round(100 * (row["test"] / rows["none"]["test"] - 1), 2)
    return {"weights": str(weights), "dtype": str(dtype).removeprefix("torch."),
            "train_context": train_ctx, "perplexity": rows}


def quantization_markdown(table: dict[str, Any]) -> str:
    """:func:`quantization_table`'s result as a Markdown table."""
    lines = ["| weights | validation ppl | Δ | test ppl | Δ |", "| --- | --- | --- | --- | --- |"]
    for mode, row in table["perplexity"].items():
        lines.append(f"| {mode if mode != 'none' else table['dtype']} | {row['valid']} | "
                     f"{row['delta_valid_pct']:+.2f}% | {row['test']} | "
                     f"{row['delta_test_pct']:+.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("weights", type=Path)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--train-context", type=int, default=0,
                        help="the training context T (0: read from training_summary.json)")
    parser.add_argument("--stream-len", type=int, default=16384)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--output", type=Path, help="write the JSON result here")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weight dtype (recurrent state stays fp32)")
    parser.add_argument("--no-length-table", action="store_true",
                        help="only perplexity and bits per byte")
    parser.add_argument("--as-window", type=int, metavar="W",
                        help="score a softmax model as sliding-window attention over W tokens: "
                             "with W = T, the context-use ratio of a model that always sees the "
                             "last T tokens (the ceiling a recurrent state is measured against)")
    parser.add_argument("--quantization", metavar="MODES",
                        help="comma-separated int8,int4: print the perplexity table of the "
                             "model quantized each way against its loaded weights (and write "
                             "it to --output) instead of the full evaluation")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train_ctx = args.train_context or training_context(args.weights)
    if args.quantization:
        table = quantization_table(args.weights, args.quantization.split(","), args.data_dir,
                                   train_ctx, getattr(torch, args.dtype))
        print(quantization_markdown(table))
        if args.output:
            args.output.write_text(json.dumps(table, indent=2) + "\n")
        return
    result = evaluate(args.weights, args.data_dir, train_ctx, args.stream_len,
                      0 if args.no_length_table else args.streams, getattr(torch, args.dtype),
                      args.as_window)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
