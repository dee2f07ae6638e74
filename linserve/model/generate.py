"""Command-line generation: ``python -m linserve.model.generate --weights weights/linear --prompt
...``.

Prefills the prompt in the parallel form, then decodes token by token in the recurrent form,
streaming text to stdout as it is produced.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from linserve.model.architectures.own_model import LanguageModel, load_model
from linserve.model.sampling import BatchParams, SamplingParams, make_generator, sample
from linserve.model.tokenizer import Tokenizer


def generate(model: LanguageModel, tok: Tokenizer, prompt: str, params: SamplingParams
             ) -> Iterator[str]:
    """Yield text pieces (whole characters only) for ``params.max_tokens`` tokens."""
    ids = tok.encode(prompt) or [tok.eos_id or 0]
    logits, state = model.prefill(torch.tensor([ids]))
    gen, bp, detok = make_generator(params.seed), BatchParams.from_params([params]), \
        tok.detokenizer()
    for _ in range(params.max_tokens):
        token = sample(logits, bp, [gen])
        tid = int(token[0])
        if tid == tok.eos_id and not params.ignore_eos:
            break
        piece = detok.add(tid)
        if piece:
            yield piece
        logits = model.step(token, state)
    rest = detok.flush()
    if rest:
        yield rest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--weights", type=Path, default=Path("weights/linear"))
    p.add_argument("--prompt", default="ROMEO.\n")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = load_model(args.weights)
    tok = Tokenizer.from_file(args.weights / model.cfg.tokenizer)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    sys.stdout.write(args.prompt)
    for piece in generate(model, tok, args.prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
