"""The engine's exact sessions on tiny random models, driven iteration by iteration: the state
a request hands back is exactly the state of "input + the tokens the session holds"."""

from __future__ import annotations

import pytest
import torch

from linserve.model.sampling import SamplingParams
from linserve.model.state import KVEntry, State
from linserve.model.tokenizer import Tokenizer
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.types import GenerationRequest, Output
from tests.model.helpers import served, tiny_model


def run(engine: Engine, req: GenerationRequest, cancel_after: int | None = None) -> Output:
    """Submit ``req`` and iterate the engine until it finishes (optionally cancelling it
    once ``cancel_after`` tokens were generated); returns the final output."""
    outs: list[Output] = []
    engine.deliver = lambda batch: outs.extend(o for _, o in batch)
    engine.submit(req, lambda _: None)
    cancelled = False
    for _ in range(500):
        engine.iterate()
        seq = next((s for s in engine.running if s.req is req), None)
        if (cancel_after is not None and not cancelled and seq is not None
                and len(seq.generated) >= cancel_after):
            engine.cancel(req.request_id, cancel_after)
            cancelled = True
        if outs and outs[-1].finish_reason is not None:
            total = Output()
            for o in outs:
                total = total.merge(o)
            return total
    raise AssertionError("the request did not finish")


def close(a: State, b: State) -> bool:
    if not torch.equal(a.lengths, b.lengths):
        return False
    for x, y in zip(a.entries(), b.entries(), strict=True):
        if isinstance(x, KVEntry) and isinstance(y, KVEntry):
            n = int(x.slots_used(a.lengths)[0])  # a window's ring: its W slots, same order
            if not torch.allclose(x.k[:, :, :n], y.k[:, :, :n], atol=1e-5):
                return False
        elif not all(torch.allclose(s, t, atol=1e-5) for s, t in
                     zip(x.tensors().values(), y.tensors().values(), strict=True)):
            return False
    return True



@pytest.mark.parametrize("kind", ["linear", "favor", "gated", "softmax", "window"])
@pytest.mark.parametrize("mode", ["chat", "cancel", "complete"])
def test_session_state_is_input_plus_held_tokens(kind: str, mode: str, tok: Tokenizer) -> None:
    # window 8: the ring wraps within the prompt and the 12 generated tokens
    extra = {"window": 8} if kind == "window" else {}
    model = tiny_model(kind, vocab_size=tok.vocab_size, max_context=4096, **extra)
    engine = Engine(served(model, tok), EngineLimits(max_running=4), lambda _: None)
    prompt = tok.encode("ROMEO. Good morrow.")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    req = GenerationRequest(f"r-{kind}-{mode}", prompt, params, want_state=True,
                            chat=mode == "chat")
    out = run(engine, req, cancel_after=5 if mode == "cancel" else None)
    assert out.final_state is not None
    held = out.final_tokens - len(prompt)
    if mode == "cancel":
        assert held == 5
    full = prompt + _held_tokens(engine, out, prompt, held, tok, mode)
    assert out.final_pending == full[-1:]
    _, want = model.prefill(torch.tensor([full[:-1]]))
    assert close(out.final_state, want)


def _held_tokens(engine: Engine, out: Output, prompt: list[int], held: int, tok: Tokenizer,
                 mode: str) -> list[int]:
    """Recompute what the session should hold from the greedy generation alone."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = run(engine, GenerationRequest(f"ref-{mode}", prompt, params))
    gen = free.token_ids
    from linserve.server.sessions.transcript import chat_turn_text, session_tokens

    if mode == "chat":
        target = session_tokens(tok, gen, chat_turn_text(tok.decode(gen)))
    else:
        target = gen[:held]
    assert len(target) == held
    return target
