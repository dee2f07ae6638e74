"""``python -m bench.engine_loop``: the engine's scheduling loop alone, without HTTP.

Runs the real :class:`linserve.server.engine.engine.Engine` in this process on the shipped weights,
with ``--clients`` closed-loop clients: each submits a request of ``--prompt-tokens`` prompt
tokens and ``--max-tokens`` outputs and, when it finishes, the next one. Deliveries are
counted in place (no queue, no JSON), so the figure splits the HTTP path's shortfall into
the engine's own per-token work (this figure against the raw step) and what HTTP adds (the
HTTP figure against this one). ``--profile`` prints where the loop's time goes (cProfile);
``minor_faults_per_step`` counts the fresh pages the loop touched (× 4 KiB: memory it was
handed anew rather than reused), which ``--malloc-threshold`` shows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import resource
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, write_json
from bench.concurrency import raw_step_tokens_per_s
from linserve.model import loader, modes
from linserve.model.sampling import SamplingParams
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.loading import pick_dtype, warm_up
from linserve.server.engine.thread_client import dispatch
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.settings import Settings
from linserve.server.system.malloc import pin_mmap_threshold


class ClosedLoop:
    """``clients`` virtual clients, ``requests`` requests in all; counts delivered tokens."""

    def __init__(self, engine: Engine, vocab: int, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.rng = random.Random(0)
        self.vocab = vocab
        self.submitted = self.finished = self.tokens = self.deliveries = 0

    def submit(self) -> None:
        if self.submitted >= self.args.requests:
            return
        self.submitted += 1
        ids = [self.rng.randrange(self.vocab) for _ in range(self.args.prompt_tokens)]
        params = SamplingParams(temperature=0.8, max_tokens=self.args.max_tokens,
                                ignore_eos=True)
        self.engine.submit(GenerationRequest(f"r{self.submitted}", ids, params), self.sink)

    def sink(self, out: Output) -> None:
        self.deliveries += 1
        self.tokens += len(out.token_ids)
        if out.finish_reason is not None:
            self.finished += 1
            self.submit()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    settings = {name: f.default for name, f in Settings.model_fields.items()}  # the defaults
    pin_mmap_threshold(args.malloc_threshold)  # 0: glibc's defaults, as the engine process
    dtype = pick_dtype(args.dtype)[0]
    model = loader.load(args.weights, dtype, batch_invariant=modes.enabled())
    warm_up(model)
    limits = EngineLimits(args.clients, 10**9, settings["prefill_chunk"],
                          settings["step_token_budget"],
                          0 if args.no_prefix_cache else 512 << 20,
                          settings["prefix_cache_interval"])
    engine = Engine(model, limits, dispatch)  # in place: no event loop, no queue
    loop = ClosedLoop(engine, model.info.vocab_size, args)
    for _ in range(args.clients):
        loop.submit()
    prof = cProfile.Profile() if args.profile else None
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    while loop.finished < args.requests:
        engine.iterate()
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(args.sort).print_stats(args.profile)
        print(text.getvalue())
    return {"dtype": dtype, "malloc_threshold": args.malloc_threshold, "clients": args.clients,
            "requests": args.requests,
            "tokens": loop.tokens, "steps": engine.steps, "wall_s": round(wall, 3),
            "tokens_per_s": round(loop.tokens / wall, 1),
            "deliveries_per_step": round(loop.deliveries / max(1, engine.steps), 2),
            "minor_faults_per_step": round(faults / max(1, engine.steps))}


def main_parser() -> argparse.ArgumentParser:
    """The command line, also used by :mod:`bench.invariance` to build its arms."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="as the server's --dtype")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--malloc-threshold", type=int, default=0,
                   help="pin glibc's mmap threshold at this many bytes (0: malloc's defaults, "
                        "as the engine process runs)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N functions with the most own time (cProfile)")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    p.add_argument("--output", default="engine_loop", help="name of the JSON written")
    return p


def main(argv: list[str] | None = None) -> None:
    args = main_parser().parse_args(argv)
    row = run(args)
    raw = raw_step_tokens_per_s(args.weights, args.clients, args.prompt_tokens, args.threads,
                                args.dtype)
    row["raw_step_tokens_per_s"] = round(raw, 1)
    row["frac_of_raw_step"] = round(row["tokens_per_s"] / raw, 3)
    print_table([row], list(row))
    if not args.profile:
        write_json(args.output, {"machine": machine(), "args": vars(args) | {
            "weights": str(args.weights)}, "rows": [row]})


if __name__ == "__main__":
    main()
