"""``python -m bench.grammar``: what structured outputs cost.

1. **Compilation**: each grammar compiled cold (first use of its text) and cached (a template
   hit plus the per-request ``deep_copy``), in the same process.
2. **The decode step with constrained rows**: the engine (real weights, fused step, the
   server's default thread count) running a batch of 64 long requests, with 0 or 32 of them
   constrained to a JSON schema (an open array of character objects, so rows stay inside the
   grammar and mix keys, enums, integers and strings). The time of one full engine iteration
   (model step, masks, sampling, matcher updates); the two batches run side by side in one
   process, alternating iteration by iteration, so drift hits both alike; medians. Also
   the time the masks take when computed alone, which the engine hides beside the step.

Writes ``bench/results/grammar.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, write_json
from linserve.model.sampling import SamplingParams
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.loading import load_engine_model, warm_up
from linserve.server.engine.types import GenerationRequest
from linserve.server.grammar.compiler import GrammarCompiler
from linserve.server.grammar.spec import GrammarSpec
from linserve.server.settings import Settings

CHARACTER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 1, "maximum": 120},
    "role": {"enum": ["king", "queen", "fool", "ghost", "soldier"]},
    "alive": {"type": "boolean"},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
    "required": ["name", "age", "role", "alive", "lines"], "additionalProperties": False}
CAST = {"type": "object", "properties": {"cast": {"type": "array", "items": CHARACTER}},
        "required": ["cast"], "additionalProperties": False}


def nested_schema(width: int) -> dict[str, Any]:
    """A larger schema: ``width`` properties of every kind, two levels deep."""
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]},
             {"type": "array", "items": {"type": "string"}}]
    inner = {f"f{i}": kinds[i % len(kinds)] for i in range(width)}
    obj = {"type": "object", "properties": inner, "required": list(inner)}
    return {"type": "object", "properties": {f"g{i}": obj for i in range(width // 4)}}


def grammars(tag: str) -> dict[str, GrammarSpec]:
    """One spec of each kind; ``tag`` makes the texts new (a cold compile each round)."""
    return {
        "json_schema (character)": GrammarSpec(
            "json_schema", json.dumps({**CHARACTER, "title": tag}), "b"),
        "json_schema (48 fields, nested)": GrammarSpec(
            "json_schema", json.dumps({**nested_schema(48), "title": tag}), "b"),
        "json_object": GrammarSpec("json_object", json.dumps({"type": "object", "title": tag}),
                                   "b"),
        "regex (date)": GrammarSpec("regex", f"(?:{tag})?[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}", "b"),
        "choice (3)": GrammarSpec("choice", json.dumps(["ay", "nay", tag]), "b"),
        "lark (arithmetic)": GrammarSpec("grammar", 'start: expr\nexpr: term (("+"|"-") term)*'
                                         f'\nterm: NUMBER | "(" expr ")" | "{tag}"\n'
                                         '%import common.NUMBER', "b"),
    }


def compile_times(compiler: GrammarCompiler, rounds: int) -> list[dict[str, Any]]:
    cold: dict[str, list[float]] = {}
    cached: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, spec in grammars(f"round{r}").items():
            t0 = time.perf_counter()
            compiler.matcher(spec)
            cold.setdefault(name, []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiler.matcher(spec)
            cached.setdefault(name, []).append(time.perf_counter() - t0)
    return [{"grammar": name, "cold_ms": statistics.median(cold[name]) * 1e3,
             "cached_ms": statistics.median(cached[name]) * 1e3} for name in cold]


MASK_MS: list[float] = []


def submitter(engine: Engine, constrained: int, prompt: list[int]) -> Any:
    """A function that submits request i (constrained if i < ``constrained``); a request that
    finishes (a JSON document can complete) is submitted again, so the batch stays full."""
    spec = GrammarSpec("json_schema", json.dumps(CAST), "b")
    count = [0]

    def submit(i: int) -> None:
        count[0] += 1
        params = SamplingParams(temperature=0.8, max_tokens=100_000, seed=count[0],
                                ignore_eos=True)
        req = GenerationRequest(f"r{count[0]}", prompt, params,
                                grammar=spec if i < constrained else None)

        def sink(out: Any) -> None:
            if out.finish_reason is not None:
                pending.append(i)

        engine.submit(req, sink)

    pending: list[int] = []
    submit.pending = pending  # type: ignore[attr-defined]
    return submit


def full_engine(model: Any, tok: Any, batch: int, constrained: int) -> tuple[Engine, Any]:
    """An engine running ``batch`` long requests, ``constrained`` of them under the schema."""
    def deliver(outs: list[tuple[Any, Any]]) -> None:
        for sink, out in outs:
            sink(out)

    engine = Engine(model, EngineLimits(max_running=batch), deliver=deliver)
    submit = submitter(engine, constrained, tok.encode("The cast of the play, as JSON:\n"))
    for i in range(batch):
        submit(i)
    while engine.steps < 20:  # past the prompts and the grammars' first tokens
        engine.iterate()
    return engine, submit


def timed_step(engine: Engine, submit: Any, batch: int) -> float | None:
    """One iteration's time if it was a pure decode step of the full batch, else None."""
    while submit.pending:
        submit(submit.pending.pop())
    full = len(engine.running) == batch and not engine.prefilling and not engine.waiting
    t0 = time.perf_counter()
    engine.iterate()
    return (time.perf_counter() - t0) * 1e3 if full else None


def step_ms(model: Any, tok: Any, batch: int, steps: int) -> dict[int, list[float]]:
    """Step times of two engines, one with no constrained rows and one with half, run in
    alternation (iteration by iteration) so that the machine's drift hits both alike."""
    engines = {k: full_engine(model, tok, batch, k) for k in (0, batch // 2)}
    times: dict[int, list[float]] = {k: [] for k in engines}
    while min(len(v) for v in times.values()) < steps:
        for k, (engine, submit) in engines.items():
            ms = timed_step(engine, submit, batch)
            if ms is not None:
                times[k].append(ms)
    engine, _ = engines[batch // 2]
    matchers = [seq.matcher for seq in engine.running]
    t0 = time.perf_counter()  # what the overlap hides: the masks alone, computed serially
    for _ in range(20):
        engine.grammars.masks(matchers)
    MASK_MS.append((time.perf_counter() - t0) / 20 * 1e3)
    for engine, _ in engines.values():
        engine.finish_all()
        engine.iterate()
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", default="grammar")
    args = p.parse_args(argv)
    model = load_engine_model(Settings.model_validate({"weights": args.weights}))
    tok = model.tokenizer()
    warm_up(model)
    compiles = compile_times(GrammarCompiler(tok, model.info.vocab_size), args.rounds)
    print_table(compiles, ["grammar", "cold_ms", "cached_ms"])
    half = args.batch // 2
    runs = step_ms(model, tok, args.batch, args.steps)
    rows = [{"batch": args.batch, "constrained_rows": k, "step_ms": statistics.median(v),
             "p90_ms": statistics.quantiles(v, n=10)[-1],
             "ratio": statistics.median(v) / statistics.median(runs[0])}
            for k, v in runs.items()]
    print_table(rows, ["batch", "constrained_rows", "step_ms", "p90_ms", "ratio"])
    print(f"masks of {half} rows computed alone: {statistics.median(MASK_MS):.3f} ms a step")
    print(write_json(args.output, {"machine": machine(), "torch_threads":
                                   torch.get_num_threads(), "compile": compiles,
                                   "step": rows, "step_times_ms": runs,
                                   "masks_alone_ms": statistics.median(MASK_MS)}))


if __name__ == "__main__":
    main()
