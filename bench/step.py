"""``python -m bench.step``: milliseconds per decode ``step`` for linear and softmax, and
for the round-2 kinds: gated linear attention and sliding-window softmax (``--kinds``).

Sweeps batch (1, 8, 32, 64), context (128 … 32k; softmax rows stop where its KV cache would
exceed the memory budget) and threads (1, 2), in fp32 and bf16 weights (state always fp32).
Each row splits the time into the layers and the embedding + LM head, and measures in the
same run the physical limit: a tight loop of exactly the step's matrix products (projections,
MLP, each layer's attention products, LM head) with the same dtype and threads.
``frac_of_limit`` = limit / step (1.0 = at the limit).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from bench.common import machine, print_table, save_figure, style_axes, time_interleaved, write_json
from linserve.model.architectures.own_model import LanguageModel
from linserve.model.layers.own_step import FusedStep
from linserve.model.own_config import ModelConfig
from linserve.model.state import KVEntry, State

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The shipped shapes of each kind (see configs/round2/).
KINDS: dict[str, dict[str, Any]] = {
    "linear": {"attention": "linear"},
    "gated": {"attention": "linear", "gate_rank": 16},
    "favor": {"attention": "favor"},
    "softmax": {"attention": "softmax"},
    "window": {"attention": "softmax", "window": 256},
}


def build(kind: str, dtype: torch.dtype, max_context: int, fused: bool) -> LanguageModel:
    """A random model of the shipped shape, with the fused step where it applies."""
    torch.manual_seed(0)
    cfg = ModelConfig(**KINDS[kind], max_context=max_context)
    model = LanguageModel(cfg).eval().to(dtype)
    model.set_fused_step(fused)
    return model


_PREFILLED: dict[tuple[int, int], State] = {}


def state_at(model: LanguageModel, batch: int, context: int) -> State:
    """A state as after ``context`` tokens. Recurrent: really prefilled with ``context``
    random tokens (one row, copied to every row of the batch; cached per model and context),
    so the step runs on the values a long session has, not on zeros. KV cache: random keys
    and values at the right length (its cost depends on the length, not the values)."""
    state = model.new_state(batch)
    kvs = [e for e in state.entries() if isinstance(e, KVEntry)]
    if kvs:
        for e in kvs:
            e.resize(kv_slots(model.cfg, context))
            e.k.normal_()
            e.v.normal_()
        state.lengths.fill_(context)
        return state
    key = (id(model), context)
    if key not in _PREFILLED:
        gen = torch.Generator().manual_seed(context)
        tokens = torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen)
        with torch.no_grad():
            _PREFILLED[key] = model.prefill(tokens)[1]
    row = _PREFILLED[key]
    state.write_rows(slice(0, batch), row)
    return state


def attention_products(model: LanguageModel, batch: int, context: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per layer, the attention's own matrix products as (out, a, b) for ``torch.bmm`` (or
    ``baddbmm_`` into ``out`` when b is given as an update), in fp32 like the real step.

    - linear: the state update s += φ(k) vᵀ (a batched rank-1 GEMM over the state) and the
      readout φ(q)ᵀ s (a batched GEMV over the state): the RNN step's unavoidable state traffic;
    - softmax: q Kᵀ and p V over ``context`` cached positions.
    """
    cfg = model.cfg
    bh = batch * cfg.n_heads
    if cfg.is_recurrent:
        f, m = cfg.feature_dim, cfg.head_dim
        s = torch.randn(bh, f, m)
        return [(s, torch.rand(bh, f, 1), torch.randn(bh, 1, m)),
                (torch.rand(bh, 1, f), s, None)]
    dh, t = cfg.head_dim, kv_slots(cfg, context)
    return [(torch.randn(bh, 1, dh), torch.randn(bh, dh, t), None),
            (torch.softmax(torch.randn(bh, 1, t), -1), torch.randn(bh, t, dh), None)]


def matmul_limit(model: LanguageModel, batch: int, context: int) -> dict[str, Callable[[], None]]:
    """A tight loop of exactly the step's matrix products: the projections and MLP with the
    model's dtype, each layer's attention products, and the LM head, as ``limit`` (whole
    step) and ``limit_layers``. Running them together, as the step does, makes the weights
    compete for cache the same way (at batch 1 the step is a memory-bound GEMV over ~21 MB
    of fp32 weights)."""
    dtype = model.dtype
    d, ff, v = model.cfg.d_model, model.cfg.d_ff, model.cfg.vocab_size
    # The fused step's own product routine (fp32 activations; a bf16-weight GEMV at small
    # batch) when it runs, else torch.mm in the weight dtype.
    mm = torch.ops.linserve.matmul if model.uses_fused_step else torch.mm
    act = torch.float32 if model.uses_fused_step else dtype
    x, h = torch.randn(batch, d, dtype=act), torch.randn(batch, ff, dtype=act)
    shapes = [(3 * d, d, x), (d, d, x), (ff, d, x), (d, ff, h)]
    # Weights [in, out] and contiguous: on this machine ``x @ W`` beats ``F.linear`` (x @ Wᵀ
    # on the stored [out, in]) by ~20%, so that is the faster, stricter limit.
    layer_ws = [([(torch.randn(i, o, dtype=dtype), inp) for o, i, inp in shapes],
                 attention_products(model, batch, context)) for _ in range(model.cfg.n_layers)]
    head = torch.randn(d, v, dtype=dtype)

    def layers() -> None:
        for linears, attn in layer_ws:  # distinct weights and states per layer
            for w, inp in linears:
                mm(inp, w)
            for out, a, b in attn:
                if b is None:
                    torch.bmm(out, a)
                else:
                    out.baddbmm_(a, b)

    def whole() -> None:
        layers()
        mm(x, head)

    return {"limit": whole, "limit_layers": layers}


def step_fns(model: LanguageModel, state: State, batch: int, compare_eager: bool = True
             ) -> dict[str, Callable[[], None]]:
    """``step`` (the one the server runs: fused where the model has it), ``layers`` (the same
    step without the final norm and LM head), then for an eager step ``head`` (embedding +
    LM head) and for a fused one, if ``compare_eager``, ``eager`` on the same state. A
    softmax cache is rewound after each call, so every call is the same work."""
    tokens = torch.randint(0, model.cfg.vocab_size, (batch,))
    fused = FusedStep(model) if model.uses_fused_step else None

    def rewind() -> None:
        state.lengths -= 1

    @torch.inference_mode()
    def layers() -> None:
        if fused is not None:
            fused(tokens, state, with_head=False)
            rewind()
            return
        x = model.embed(tokens)
        for i, block in enumerate(model.layers):
            x = block.step(x, state, i)

    def step() -> None:
        model.step(tokens, state)
        rewind()

    def eager() -> None:
        model.step_eager(tokens, state)
        rewind()

    @torch.inference_mode()
    def head() -> None:
        model._head(model.embed(tokens))

    fns: dict[str, Callable[[], None]] = {"step": step, "layers": layers}
    if fused is None:
        fns["head"] = head  # eager: the embedding + head on its own
    elif compare_eager:
        fns["eager"] = eager
    return fns


def measure_row(model: LanguageModel, batch: int, ctx: int, with_limit: bool = True
                ) -> dict[str, float]:
    """Step, layers, head, eager step and matmul limit of one configuration, timed
    interleaved; a fused step's embedding + head is the step minus its layers."""
    fns = step_fns(model, state_at(model, batch, ctx), batch)
    if with_limit:
        fns.update(matmul_limit(model, batch, ctx))
    t = time_interleaved(fns)
    t.setdefault("head", t["step"] - t["layers"])  # fused: what the layers-only call skips
    return t


def kv_slots(cfg: ModelConfig, context: int) -> int:
    """Cached positions one step reads after ``context`` tokens (a window reads at most W)."""
    return min(context + 1, cfg.window) if cfg.window else context + 1


def kv_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    return 2 * batch * cfg.n_layers * cfg.d_model * kv_slots(cfg, context) * 4


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dname in args.dtypes:
            for kind in args.kinds:
                model = build(kind, DTYPES[dname], max(args.contexts) + 1, args.fused)
                for batch in args.batches:
                    for ctx in args.contexts:
                        base = {"kind": kind, "dtype": dname, "threads": threads,
                                "batch": batch, "context": ctx}
                        if (not model.cfg.is_recurrent
                                and kv_bytes(model.cfg, batch, ctx) > args.kv_budget):
                            rows.append({**base, "step_ms": None,
                                         "note": "KV cache over memory budget"})
                            continue
                        rows.append(result_row(base, model, measure_row(model, batch, ctx)))
    return rows


def result_row(base: dict[str, Any], model: LanguageModel, t: dict[str, float]
               ) -> dict[str, Any]:
    row = {**base, "step_ms": t["step"], "layers_ms": t["layers"], "head_ms": t["head"],
           "eager_step_ms": t.get("eager"), "fused": model.uses_fused_step,
           "limit_ms": t["limit"], "limit_layers_ms": t["limit_layers"],
           "frac_of_limit": t["limit"] / t["step"],
           "layers_frac_of_limit": t["limit_layers"] / t["layers"],
           "tokens_per_s": base["batch"] / t["step"] * 1000}
    eager = t.get("eager")
    print(f"{base['kind']:8s} {base['dtype']} t={base['threads']} B={base['batch']:3d} "
          f"ctx={base['context']:6d} step={t['step']:8.3f} ms  layers={t['layers']:7.3f}  "
          f"head={t['head']:6.3f}  limit={t['limit']:6.3f}  frac={row['frac_of_limit']:.2f}  "
          f"eager={eager if eager is None else round(eager, 3)}", flush=True)
    return row


def plot(rows: list[dict[str, Any]], context: int, name: str = "step") -> None:
    """Step time and matmul limit against batch, at one context, per dtype and thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["dtype"], r["threads"]) for r in rows})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, (dtype, threads) in zip(axes[0], combos, strict=True):
        for kind, color in (("linear", "tab:blue"), ("gated", "tab:green"),
                            ("softmax", "tab:red"), ("window", "tab:orange")):
            pts = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype
                   and r["threads"] == threads and r["context"] == context
                   and r.get("step_ms") is not None]
            if not pts:
                continue
            xs = [r["batch"] for r in pts]
            ax.plot(xs, [r["step_ms"] for r in pts], "o-", color=color, label=f"{kind} step")
            if kind == "linear":
                ax.plot(xs, [r["limit_ms"] for r in pts], "k--", label="matmul limit")
        style_axes(ax, "batch", "ms per step", f"{dtype}, {threads} thread(s), context {context}",
                   legend_size=8)
    save_figure(fig, f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["linear", "softmax"], choices=list(KINDS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", nargs="+", type=int,
                        default=[128, 512, 2048, 4096, 8192, 32768])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--kv-budget", type=float, default=6e9, help="bytes of KV cache allowed")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="time the eager step only (the fused step is the default)")
    parser.add_argument("--output", default="step")
    args = parser.parse_args(argv)
    rows = run(args)
    print()
    print_table([r for r in rows if r.get("step_ms") is not None],
                ["kind", "dtype", "threads", "batch", "context", "step_ms", "layers_ms",
                 "head_ms", "limit_ms", "frac_of_limit", "eager_step_ms"])
    path = write_json(args.output, {"machine": machine(), "rows": rows})
    plot(rows, 4096 if 4096 in args.contexts else args.contexts[0], args.output)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
