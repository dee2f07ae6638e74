"""Write a checkpoint's ``MODEL_CARD.md``: ``python -m linserve.model.training.card
weights/linear``.

Reads ``training_summary.json`` (written by ``linserve.model.training.train``) and ``eval.json``
(written by ``linserve.model.training.evaluate --output``) from the weights folder and adds three
samples at temperature 0.8 with their seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from linserve.model.architectures.own_model import load_model
from linserve.model.generate import generate
from linserve.model.sampling import SamplingParams
from linserve.model.tokenizer import Tokenizer
from linserve.model.training.evaluate import quantization_markdown, slice_perplexity

SAMPLE_PROMPTS = ("ROMEO.\n", "KING.\nWhat news from France?\n\n", "Enter HAMLET.\n\nHAMLET.\n")


def samples(weights: Path, n_tokens: int = 80) -> list[tuple[str, int, str]]:
    model = load_model(weights)
    tok = Tokenizer.from_file(weights / model.cfg.tokenizer)
    out = []
    for seed, prompt in enumerate(SAMPLE_PROMPTS):
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=n_tokens)
        out.append((prompt, seed, "".join(generate(model, tok, prompt, params))))
    return out


def length_table(ev: dict[str, Any]) -> str:
    rows = ["| position bucket | perplexity |", "| --- | --- |"]
    for r in ev["length_generalisation"]:
        ppl = r["ppl"] if r["ppl"] is not None else r.get("note", "-")
        rows.append(f"| {r['bucket']} | {ppl} |")
    return "\n".join(rows)


def length_note(cfg: dict[str, Any], train_ctx: int) -> list[str]:
    if cfg.get("window"):
        return [f"Sliding-window attention sees the last {cfg['window']} tokens; its KV cache "
                "is a ring of that many slots, so the whole 16k stream runs through it in "
                "constant memory.", ""]
    if cfg["attention"] == "softmax":
        return [f"Softmax attention is evaluated with its full KV cache up to its maximum "
                f"context ({cfg['max_context']}); past that the server refuses the request "
                "(400, `context_length_exceeded`), so those buckets are marked refused. Its "
                f"rotary positions were trained on {train_ctx}-token windows.", ""]
    return ["The recurrent state has no length limit: the whole 16k stream runs through it "
            "(equivalently, in prefill chunks carrying the state).", ""]


def render(weights: Path) -> str:
    summary = json.loads((weights / "training_summary.json").read_text())
    ev = json.loads((weights / "eval.json").read_text())
    cfg = json.loads((weights / "config.json").read_text())
    tc = summary["train_config"]
    name = weights.name
    lines = [
        f"# {name}", "",
        f"A {cfg['n_layers']}-layer, {cfg['n_heads']}-head, d_model {cfg['d_model']} decoder "
        f"with **{_kind(cfg)}** attention ({summary['n_params']:,} parameters), trained "
        "on Shakespeare's works. See `../DATA_CARD.md` for the data and split.", "",
        "| | |", "| --- | --- |",
        f"| attention | {_positions(cfg)} |",
        f"| tokens seen | {summary['tokens_seen']:,} ({summary['steps']} steps × "
        f"{tc['batch_size']} × {tc['seq_len']}) |",
        f"| wall time | {summary['wall_seconds'] / 60:.1f} min on 1 thread (the runs of one "
        "budget shared 2 cores) |",
        f"| schedule | AdamW lr {tc['lr']} → {tc['min_lr']}, warmup {tc['warmup_steps']}, "
        f"cosine, clip {tc['grad_clip']}, wd {tc['weight_decay']}, bf16 autocast "
        f"{tc['bf16']}, seed {tc['seed']} |",
        f"| best validation loss | {summary['best_val_loss']:.4f} |",
        f"| validation perplexity | {ev['valid']['ppl']} ({ev['valid']['bits_per_byte']} "
        "bits/byte) |",
        f"| test perplexity | {ev['test']['ppl']} ({ev['test']['bits_per_byte']} bits/byte) |",
        f"| test-slice perplexity | {slice_perplexity(weights):.3f} |",
        *context_use_row(ev),
        "", "Perplexities use non-overlapping windows of the training context "
        f"({ev['train_context']} tokens), each from an empty state.", "",
        *quantization_section(weights),
        "## Length generalisation", "",
        f"Held-out works fed as {ev['n_streams']} streams of 16,385 tokens through the stateful "
        "form; perplexity by position (T = training context):", "",
        length_table(ev), "", *length_note(cfg, ev["train_context"]),
        "## Samples (temperature 0.8)", ""]
    for prompt, seed, text in samples(weights):
        lines += [f"Seed {seed}, prompt {prompt!r}:", "", "```", prompt + text, "```", ""]
    lines += ["## Reproduce", "", "```bash", "python -m linserve.model.training.data",
              f"python -m linserve.model.training.train --config {config_path(name)}",
              f"python -m linserve.model.training.evaluate weights/{name} "
              f"--output weights/{name}/eval.json",
              f"python -m linserve.model.training.evaluate weights/{name} --quantization int8,int4 "
              f"--output weights/{name}/quantization.json",
              f"python -m linserve.model.training.card weights/{name}", "```", ""]
    return "\n".join(lines)


def quantization_section(weights: Path) -> list[str]:
    """The weight-quantization table (``quantization.json``), when the folder has one."""
    path = weights / "quantization.json"
    if not path.is_file():
        return []
    table = json.loads(path.read_text())
    return ["## Weight quantization", "",
            "Perplexity with every GEMM weight quantized at load time (`--quantization`; "
            "int8 per output channel, int4 in groups of 32 with fp16 scales; embeddings, "
            "norms and states unchanged), against the weights as trained:", "",
            quantization_markdown(table), ""]


def context_use_row(ev: dict[str, Any]) -> list[str]:
    """The context-use ratio's table row, when the evaluation has one."""
    cu = ev.get("context_use")
    if not cu:
        return []
    return [f"| context-use ratio | {cu['ratio']} (perplexity {cu['ppl_carried']} with the "
            f"state carried through {cu['streams']} test streams of {cu['stream_tokens']:,} "
            f"tokens, {cu['ppl_reset']} with it reset every {cu['positions_from']}; positions "
            f"≥ {cu['positions_from']}) |"]


def config_path(name: str, root: Path = Path("configs")) -> str:
    """The training config that exports to ``weights/<name>``."""
    for path in sorted(root.rglob("*.json")):
        try:
            if json.loads(path.read_text()).get("export_dir") == f"weights/{name}":
                return str(path)
        except (OSError, ValueError, AttributeError):
            continue
    return f"configs/{name}.json"


def _positions(cfg: dict[str, Any]) -> str:
    """How the model knows positions: the softmax baselines use rotary embeddings and their
    config's conv_size is unused; the linear kinds use the short convolution."""
    if cfg.get("window"):
        return (f"sliding-window softmax (window {cfg['window']}, a ring-buffer KV cache), "
                "rotary positions, no max context")
    if cfg["attention"] == "softmax":
        return f"softmax, rotary positions (max_context {cfg['max_context']})"
    gate = (f", a data-dependent forget gate (GLA, rank {cfg['gate_rank']})"
            if cfg.get("gate_rank") else "")
    return (f"{cfg['attention']}{gate}, causal convolution of width {cfg['conv_size']}, "
            "no max context")


def _kind(cfg: dict[str, Any]) -> str:
    if cfg.get("gate_rank"):
        return f"gated {cfg['attention']}"
    return "sliding-window softmax" if cfg.get("window") else str(cfg["attention"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("weights", type=Path)
    args = p.parse_args(argv)
    (args.weights / "MODEL_CARD.md").write_text(render(args.weights))
    print(f"wrote {args.weights / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
