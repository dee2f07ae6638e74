"""``python -m bench.spec_decode``: what speculative decoding costs and gives on a CPU.

1. **Verify cost** T(k+1) ÷ T(1): one verify of k drafts (``ServedModel.verify`` of k + 1
   tokens, the native ``decoder_verify`` for Qwen3.5) over one plain decode step, batch 1, on
   a checkpoint
   (default: random weights of Qwen3.5-0.8B's shapes, ``python -m bench.hf``), in bf16,
   int8 and int4, timed alternately; ``cost-4b``: the same on a 4B-class shape
   (``bench.hf.SHAPE_4B``, random weights, made at ``--checkpoint-4b`` if missing).
2. **Speedup against acceptance** at batch 1: the engine generating with drafts that are the
   model's own greedy continuation, each position's draft replaced by a wrong token with
   probability 1 − α (an oracle proposer, so that α is what is measured against), k = 3,
   and adaptive (the default) at α = 0, against plain decoding.
3. **16 streams** with ``--speculative-config`` on (the batch is above ``max_batch``, so
   every step is plain) against it off.
4. **The trained checkpoint** (``trained``): MTP and n-gram drafts on validation prompts and
   copy-heavy ones, acceptance by position; ``continuation``: n-gram drafts over a 256-token
   greedy continuation; ``mtp``: what one MTP draft costs on the shapes above.

Writes ``bench/results/spec_decode.json`` and ``spec_decode.png``. Never run by CI.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    RESULTS,
    machine,
    print_table,
    read_json,
    save_figure,
    time_interleaved,
    write_json,
)
from linserve.model import kernels, loader
from linserve.model.heap import keep_scratch
from linserve.model.interface import ServedModel
from linserve.model.sampling import SamplingParams
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.types import GenerationRequest
from linserve.server.speculative.config import SpeculativeConfig

K = 3


def verify_costs(path: Path, quant: str, k_max: int = 5, dtype: str = "bfloat16"
                 ) -> dict[str, Any]:
    model = loader.load(path, dtype, quantization=quant)
    keep_scratch()  # as the engine does once its weights are in (model/heap.py)
    _, state = model.prefill(torch.randint(0, 1000, (1, 64)))
    fns: dict[str, Callable[[], object]] = {
        "step": lambda: model.step(torch.tensor([5]), state.copy())}
    for t in range(1, k_max + 1):
        toks = torch.randint(0, 1000, (1, t))
        fns[f"T{t}"] = partial(lambda x: model.verify(x, state.copy()), toks)
    ms = time_interleaved(fns, rounds=5, round_seconds=0.5)
    row: dict[str, Any] = {"quantization": quant, "dtype": dtype, "isa": isa(),
                           "step_ms": round(ms["step"], 2)}
    for t in range(1, k_max + 1):
        row[f"k={t - 1}"] = round(ms[f"T{t}"] / ms["step"], 3)
    return row


def isa() -> str:
    """The vector width the kernels run at here (rows of both are kept apart)."""
    return "avx512" if "avx512f" in kernels.cpu_flags() else "avx2"


def merge(old: list[dict[str, Any]] | None, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cost rows: ``new``'s, and ``old``'s for weights not measured now."""
    def weights(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["quantization"], r.get("dtype", "bfloat16"), r.get("isa", "avx512")

    done = {weights(r) for r in new}
    return [r for r in old or [] if weights(r) not in done] + new


def config(**extra: object) -> SpeculativeConfig:
    return SpeculativeConfig.model_validate({"method": "ngram", "num_speculative_tokens": K,
                                             "max_batch": 4, **extra})


class Oracle:
    """Drafts the reference continuation, each token wrong with probability 1 − α."""

    def __init__(self, reference: list[int], prompt_len: int, alpha: float) -> None:
        self.ref, self.n, self.alpha = reference, prompt_len, alpha
        self.rng = random.Random(0)

    def propose(self, key: str, history: list[int], k: int) -> list[int]:
        at = len(history) - self.n
        out = []
        for tok in self.ref[at: at + k]:
            out.append(tok if self.rng.random() < self.alpha else (tok + 1) % 1000)
        return out

    needs_hidden = False
    costly = False

    def commit(self, key: str, fed: list[int], after: int,
               hidden: torch.Tensor | None) -> None:
        pass

    def drop(self, key: str) -> None:
        pass


def generate(model: ServedModel, prompts: list[list[int]], n: int,
             config: SpeculativeConfig | None, oracle: Oracle | None = None
             ) -> tuple[float, list[list[int]], Engine]:
    """Seconds to generate ``n`` greedy tokens for every prompt at once, and the tokens."""
    eng = Engine(model, EngineLimits(max_running=32), lambda _: None, speculative=config)
    if oracle is not None and eng.spec is not None:
        eng.spec.proposer = oracle
    outs: dict[str, list[int]] = {}
    eng.deliver = lambda batch: [outs.setdefault(str(s), []).extend(o.token_ids)  # type: ignore
                                 for s, o in batch]
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(GenerationRequest(f"g{i}", p, params), f"g{i}")  # type: ignore[arg-type]
    eng.iterate()  # the prompts' prefill and first tokens, not timed
    t0 = time.perf_counter()
    while eng.running or eng.prefilling or eng.waiting:
        eng.iterate()
    return time.perf_counter() - t0, [outs[f"g{i}"] for i in range(len(prompts))], eng


def paired(model: ServedModel, prompts: list[list[int]], n: int,
           config: SpeculativeConfig | None, oracle: Callable[[], Oracle] | None = None,
           rounds: int = 3) -> tuple[float, float, Engine]:
    """Seconds of plain and of speculative generation, each the median of ``rounds`` runs
    taken alternately (this VM's bandwidth drifts within minutes); checks the text is the
    same."""
    plain, spec = [], []
    eng: Engine | None = None
    for _ in range(rounds):
        secs, want, _ = generate(model, prompts, n, None)
        plain.append(secs)
        secs, got, eng = generate(model, prompts, n, config, oracle() if oracle else None)
        spec.append(secs)
        assert got == want, "speculation changed the greedy text"
    assert eng is not None
    return sorted(plain)[rounds // 2], sorted(spec)[rounds // 2], eng


def acceptance_sweep(path: Path, n: int) -> list[dict[str, Any]]:
    model = loader.load(path, "bfloat16")
    prompt = torch.randint(0, 1000, (48,)).tolist()
    _, ref, _ = generate(model, [prompt], n, None)
    rows = []
    for alpha in (0.0, 0.5, 0.7, 0.8, 0.9, 1.0):
        for name, c in ((f"k={K}", config(adaptive=False)), ("adaptive", config())):
            if name == "adaptive" and alpha not in (0.0, 0.5, 1.0):
                continue
            plain_s, spec_s, eng = paired(model, [prompt], n, c,
                                          partial(Oracle, ref[0], 48, alpha))
            assert eng.spec is not None
            rows.append({"alpha": alpha, "mode": name,
                         "plain_tok_s": round((n - 1) / plain_s, 2),
                         "spec_tok_s": round((n - 1) / spec_s, 2),
                         "speedup": round(plain_s / spec_s, 3),
                         "kept": f"{eng.spec.accepted}/{eng.spec.drafted}"})
            print(rows[-1], flush=True)
    return rows


def trained(path: Path, data: Path, n: int, dtype: str = "auto") -> list[dict[str, Any]]:
    """The trained checkpoint (``weights/qwen35-mtp``) at batch 1: validation-text prompts
    (MTP, n-gram) and copy-heavy ones (a passage, then its first words again: n-gram),
    greedy; acceptance per draft position and tokens/s against plain decoding."""
    model = loader.load(path, dtype)
    tok = model.tokenizer()
    text = tok.encode((data / "valid.txt").read_text()[:200_000])
    plain_prompts = [text[i * 5000: i * 5000 + 96] for i in range(1, 5)]
    copy_prompts = [p + tok.encode("\n\n") + p[:12] for p in
                    (text[i * 7000: i * 7000 + 120] for i in range(1, 5))]
    cases: list[tuple[str, list[list[int]], SpeculativeConfig]] = []
    for k in (1, 2, 3):
        cases.append((f"mtp k={k}", plain_prompts,
                      config(method="mtp", num_speculative_tokens=k, adaptive=False)))
    cases.append(("mtp adaptive", plain_prompts, config(method="mtp")))
    cases.append(("ngram k=3, prose", plain_prompts, config(adaptive=False)))
    cases.append(("ngram k=3, copy", copy_prompts, config(adaptive=False)))
    cases.append(("ngram adaptive, copy", copy_prompts, config()))
    rows = []
    for name, prompts, c in cases:
        plain_t = spec_t = 0.0
        kept = [0] * c.num_speculative_tokens
        tried = [0] * c.num_speculative_tokens
        for p in prompts:  # batch 1, one prompt after another
            a, b, eng = paired(model, [p], n, c)
            plain_t, spec_t = plain_t + a, spec_t + b
            assert eng.spec is not None
            kept = [x + y for x, y in zip(kept, eng.spec.kept_at, strict=True)]
            tried = [x + y for x, y in zip(tried, eng.spec.tried_at, strict=True)]
        per_pos = [round(k / t, 3) if t else None for k, t in zip(kept, tried, strict=True)]
        rows.append({"case": name, "plain_tok_s": round(len(prompts) * (n - 1) / plain_t, 1),
                     "spec_tok_s": round(len(prompts) * (n - 1) / spec_t, 1),
                     "speedup": round(plain_t / spec_t, 3),
                     "accepted_by_position": per_pos, "drafts_tried": tried})
        print(rows[-1], flush=True)
    return rows


def continuation(path: Path, data: Path, n: int = 256, dtype: str = "auto"
                 ) -> dict[str, Any]:
    """n-gram drafts (k = 3) on a long greedy continuation of the trained checkpoint, which
    repeats itself as small models do: one validation-text prompt, batch 1."""
    model = loader.load(path, dtype)
    prompt = model.tokenizer().encode((data / "valid.txt").read_text()[:20_000])[5000:5096]
    plain_s, spec_s, eng = paired(model, [prompt], n, config(adaptive=False))
    assert eng.spec is not None
    row = {"case": f"ngram k=3, {n}-token continuation",
           "plain_tok_s": round((n - 1) / plain_s, 1), "spec_tok_s": round((n - 1) / spec_s, 1),
           "speedup": round(plain_s / spec_s, 3),
           "kept": f"{eng.spec.accepted}/{eng.spec.drafted}"}
    print(row, flush=True)
    return row


def with_mtp(path: Path, out: Path) -> Path:
    """``path``'s checkpoint with one random MTP layer (the last full-attention layer's
    weights, a random fc): what an MTP draft costs at these shapes, not what it accepts."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    out.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.suffix != ".gguf":
            shutil.copy(f, out / f.name)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    prefix = next(n for n in tensors if n.endswith("norm.weight") and "layers" not in n)
    prefix = prefix.removesuffix("norm.weight")
    last = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    d, layer = int(text["hidden_size"]), f"{prefix}layers.{last}."
    for name in [n for n in tensors if n.startswith(layer)]:
        tensors["mtp.layers.0." + name.removeprefix(layer)] = tensors[name].clone()
    dtype = tensors[f"{prefix}norm.weight"].dtype
    tensors["mtp.fc.weight"] = (torch.randn(d, 2 * d) / (2 * d) ** 0.5).to(dtype)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(d, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def mtp_cost(path: Path) -> dict[str, Any]:
    """One MTP draft token (the layer and the head) over one plain step, batch 1, bf16."""
    model = loader.load(with_mtp(path, Path("/tmp/spec-decode-mtp")), "bfloat16")
    head = model.draft_head()
    assert head is not None
    _, state = model.prefill(torch.randint(0, 1000, (1, 64)))
    mstate = head.new_state()
    g = torch.zeros(1, getattr(model, "module").cfg.hidden_size)  # noqa: B009
    head.extend(mstate, g, [1])

    def draft() -> None:
        head.logits(head.extend(mstate, g, [5]))
        mstate.lengths[:] = 1

    ms = time_interleaved({"step": lambda: model.step(torch.tensor([5]), state.copy()),
                           "draft": draft}, rounds=5, round_seconds=0.5)
    return {"step_ms": round(ms["step"], 2), "mtp_draft_ms": round(ms["draft"], 2),
            "ratio": round(ms["draft"] / ms["step"], 3)}


def streams(path: Path, n: int, rows: int = 16) -> dict[str, Any]:
    model = loader.load(path, "bfloat16")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (32,), generator=g).tolist() for _ in range(rows)]
    cfg = config()
    times: dict[str, float] = {"plain": float("inf"), "spec": float("inf")}
    for _ in range(2):
        for name, c in (("plain", None), ("spec", cfg)):
            times[name] = min(times[name], generate(model, prompts, n, c)[0])
    return {"streams": rows, "plain_s": round(times["plain"], 2),
            "spec_s": round(times["spec"], 2),
            "ratio": round(times["plain"] / times["spec"], 3)}


def plot(sweep: list[dict[str, Any]], costs: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for c in costs:
        ks = [k for k in c if k.startswith("k=")]
        label = c["quantization"] if c["quantization"] != "none" else c.get("dtype", "bfloat16")
        label += f" ({c.get('isa', 'avx512').upper()})"
        a.plot([int(k[2:]) for k in ks], [c[k] for k in ks], marker="o", label=label)
    a.axhline(1.3, ls=":", c="grey")
    a.set(xlabel="drafts k", ylabel="T(k+1) / T(1)", title="verify cost, batch 1")
    a.legend()
    fixed = [r for r in sweep if r["mode"] == f"k={K}"]
    b.plot([r["alpha"] for r in fixed], [r["speedup"] for r in fixed], marker="o",
           label=f"k={K}")
    ad = [r for r in sweep if r["mode"] == "adaptive"]
    b.plot([r["alpha"] for r in ad], [r["speedup"] for r in ad], "s", label="adaptive")
    b.axhline(1.0, ls=":", c="grey")
    b.set(xlabel="acceptance α", ylabel="speedup over plain decoding",
          title="batch 1, greedy")
    b.legend()
    save_figure(fig, "spec_decode.png")


def plot_trained(out: dict[str, Any]) -> None:
    """``spec_decode_trained.png``: the speedup of each case on every trained checkpoint
    and weights measured (the ``trained:NAME:DTYPE`` rows), beside the 7M model's."""
    import matplotlib.pyplot as plt
    runs = {k.removeprefix("trained").strip(":") or "qwen35-mtp": v
            for k, v in out.items() if k.startswith("trained")}
    cases = [r["case"] for r in next(iter(runs.values()))]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(runs)
    for i, (name, rows) in enumerate(runs.items()):
        speed = {r["case"]: r["speedup"] for r in rows}
        ax.bar([c + i * width for c in range(len(cases))], [speed.get(c, 0) for c in cases],
               width, label=name)
    ax.axhline(1.0, ls=":", c="grey")
    ax.axhline(1.5, ls="--", c="grey", lw=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=20,
                  ha="right", fontsize=8)
    ax.set(ylabel="speedup over plain decoding", title="trained checkpoints, batch 1, greedy")
    ax.legend(fontsize=8)
    save_figure(fig, "spec_decode_trained.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/qwen3.5-0.8b-shapes"))
    p.add_argument("--checkpoint-4b", type=Path, default=Path("/tmp/qwen3.5-4b-shapes"),
                   help="the 4B-class shape of cost-4b (made there if missing)")
    p.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"],
                   help="the weights of the cost parts (rows of other weights are kept)")
    p.add_argument("--cost-dtype", default="bfloat16",
                   help="the cost parts' weights (and the dtype beside int8 / int4): "
                        "bfloat16, or float32 (what auto serves on an AVX2 CPU)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--trained", type=Path, default=Path("weights/qwen35-mtp"))
    p.add_argument("--dtype", default="auto",
                   help="the trained checkpoint's weights in the trained parts (auto: bf16 "
                        "where the CPU multiplies it natively, else fp32)")
    p.add_argument("--data-dir", type=Path, default=Path("data"),
                   help="the corpus (python -m linserve.model.training.data)")
    p.add_argument("--parts", nargs="+",
                   default=["cost", "cost-4b", "sweep", "streams", "trained", "continuation",
                            "mtp"])
    args = p.parse_args()
    old = RESULTS / "spec_decode.json"  # the parts not run now are kept
    out: dict[str, Any] = read_json("spec_decode") if old.is_file() else {}
    out["machine"] = machine()
    if "cost" in args.parts:  # the 0.8B shapes' rows under "verify_cost", another's apart
        key = "verify_cost" if args.checkpoint.name == "qwen3.5-0.8b-shapes" \
            else f"verify_cost:{args.checkpoint.resolve().name}"
        out[key] = merge(out.get(key), [verify_costs(args.checkpoint, q, dtype=args.cost_dtype)
                                        for q in args.quantizations])
        print_table(out[key], list(out[key][0]))
    if "cost-4b" in args.parts:
        if not (args.checkpoint_4b / "config.json").is_file():
            from bench.hf import SHAPE_4B, make
            make(args.checkpoint_4b, SHAPE_4B)
        out["verify_cost_4b"] = merge(out.get("verify_cost_4b"),
                                      [verify_costs(args.checkpoint_4b, q,
                                                    dtype=args.cost_dtype)
                                       for q in args.quantizations])
        print_table(out["verify_cost_4b"], list(out["verify_cost_4b"][0]))
    if "sweep" in args.parts:
        out["acceptance"] = acceptance_sweep(args.checkpoint, args.tokens)
    if "streams" in args.parts:
        out["streams"] = streams(args.checkpoint, 24)
        print(out["streams"])
    # the shipped 7M checkpoint's rows under "trained", another's under "trained:NAME"
    suffix = "" if args.trained.resolve().name == "qwen35-mtp" and args.dtype == "auto" \
        else f":{args.trained.resolve().name}:{args.dtype}"
    if "trained" in args.parts:
        out["trained" + suffix] = trained(args.trained, args.data_dir, 64, args.dtype)
    if "continuation" in args.parts:
        out["continuation" + suffix] = continuation(args.trained, args.data_dir,
                                                    dtype=args.dtype)
    if "mtp" in args.parts:
        out["mtp_cost"] = mtp_cost(args.checkpoint)
        print(out["mtp_cost"])
    write_json("spec_decode", out)
    if "verify_cost" in out and "acceptance" in out:
        plot(out["acceptance"], out["verify_cost"])
    if any(k.startswith("trained") for k in out):
        plot_trained(out)


if __name__ == "__main__":
    main()
