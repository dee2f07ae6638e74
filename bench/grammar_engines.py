"""``python bench/grammar_engines.py``: the three maintained CPU grammar engines on this
project's tokenizer, measured the same way, to choose one (README, "Structured outputs").

Run it in a scratch venv outside the project, since xgrammar pulls in transformers and
triton (see ``bench/grammar_engines.sh``). For each engine that is installed: the time to
load the tokenizer, to compile a JSON schema cold and again, and the per-token mask time
over 20 random walks through the grammar. Prints JSON.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TOKENIZER = Path(__file__).resolve().parents[1] / "weights" / "tokenizer.json"
VOCAB = 8192
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "roles": {"type": "array", "items": {"enum": ["king", "fool", "ghost"]}, "maxItems": 4},
    "alive": {"type": "boolean"}}, "required": ["name", "age", "alive"],
    "additionalProperties": False}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def walk(fill: Callable[[], torch.Tensor], accept: Callable[[int], bool], steps: int = 300
         ) -> list[float]:
    """One random walk: mask, draw an allowed token, accept it; the mask times in ms."""
    times = []
    for _ in range(steps):
        allowed, ms = timed(fill)
        times.append(ms)
        logits = torch.randn(VOCAB).masked_fill(~allowed, float("-inf"))
        if accept(int(torch.softmax(logits * 3, -1).multinomial(1))):
            break
    return times


def unpack(bits: Any) -> torch.Tensor:
    packed = torch.as_tensor(bits).reshape(-1)
    shifts = torch.arange(32, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten()[:VOCAB]


def llguidance_figures() -> dict[str, float]:
    import llguidance
    import llguidance.numpy as lnp

    tok, t_tok = timed(lambda: llguidance.LLTokenizer(TOKENIZER.read_text(), eos_token=0))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    _, cold = timed(lambda: llguidance.LLMatcher(tok, grammar))
    template, warm = timed(lambda: llguidance.LLMatcher(tok, grammar))
    mask = lnp.allocate_token_bitmask(1, VOCAB)
    times: list[float] = []
    for _ in range(20):
        m = template.deep_copy()

        def fill(m: Any = m) -> torch.Tensor:
            lnp.fill_next_token_bitmask(m, mask, 0)
            return unpack(mask)

        def accept(t: int, m: Any = m) -> bool:
            m.consume_token(t)
            return bool(m.is_stopped())

        times += walk(fill, accept)
    return {"tokenizer_ms": t_tok, "compile_cold_ms": cold, "compile_again_ms": warm,
            "mask_p50_ms": statistics.median(times), "mask_max_ms": max(times)}


def xgrammar_figures() -> dict[str, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    def load() -> Any:
        hf = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>")
        return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB))

    compiler, t_tok = timed(load)
    compiled, cold = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    _, warm = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    times: list[float] = []
    for _ in range(20):
        m = xgr.GrammarMatcher(compiled)

        def fill(m: Any = m) -> torch.Tensor:
            m.fill_next_token_bitmask(mask)
            return unpack(mask)

        def accept(t: int, m: Any = m) -> bool:
            m.accept_token(t)
            return bool(m.is_terminated())

        times += walk(fill, accept)
    return {"tokenizer_ms": t_tok, "compile_cold_ms": cold, "compile_again_ms": warm,
            "mask_p50_ms": statistics.median(times), "mask_max_ms": max(times)}


def outlines_core_figures() -> dict[str, float]:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocab: dict[str, list[int]] = {}
    for piece, i in json.loads(TOKENIZER.read_text())["model"]["vocab"].items():
        if i != 0:
            vocab.setdefault(piece, []).append(i)
    voc, t_tok = timed(lambda: Vocabulary(0, vocab))
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    _, cold = timed(lambda: Index(regex, voc))
    return {"tokenizer_ms": t_tok, "compile_cold_ms": cold,
            "note": "regex-based: no recursive schemas, no context-free grammars"}  # type: ignore[dict-item]


ENGINES = {"llguidance": llguidance_figures, "xgrammar": xgrammar_figures,
           "outlines_core": outlines_core_figures}


def main() -> None:
    report: dict[str, Any] = {}
    for name, fn in ENGINES.items():
        if importlib.util.find_spec(name) is None:
            report[name] = "not installed"
            continue
        report[name] = fn()
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
