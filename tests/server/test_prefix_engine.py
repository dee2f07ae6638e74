"""The prefix cache inside the engine, on tiny random models: output with the cache equals
output without it (greedy and seeded; linear, FAVOR+, gated, softmax and sliding-window),
and hits land where they should (resent conversations, a prompt diverging inside a cached
span, a shared system prompt, concurrent requests, evictions)."""

from __future__ import annotations

import pytest

from linserve.model.sampling import SamplingParams
from linserve.model.tokenizer import Tokenizer
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.prefix_cache.engine_side import MIN_BRANCH, memory_parts
from tests.model.helpers import served, tiny_model

KINDS = ["linear", "favor", "gated", "softmax", "window"]



def engines(kind: str, tok: Tokenizer, budget: int = 1 << 30, **limits: int
            ) -> tuple[Engine, Engine]:
    """The same tiny model behind an engine with the cache and one without."""
    model = served(tiny_model(kind, vocab_size=tok.vocab_size, max_context=4096), tok)
    base = dict(max_running=8, prefill_chunk=64, step_token_budget=256,
                prefix_cache_interval=64, **limits)
    on = Engine(model, EngineLimits(prefix_cache_bytes=budget, **base), lambda _: None)
    off = Engine(model, EngineLimits(prefix_cache_bytes=0, **base), lambda _: None)
    return on, off


def run_many(engine: Engine, reqs: list[GenerationRequest]) -> list[Output]:
    """Submit all of ``reqs`` at once; iterate until each finished; merged outputs."""
    outs: dict[str, Output] = {r.request_id: Output() for r in reqs}
    engine.deliver = lambda batch: [outs.__setitem__(rid, outs[rid].merge(o))  # type: ignore[func-returns-value]
                                    for rid, o in batch]
    for r in reqs:
        engine.submit(r, r.request_id)
    for _ in range(2000):
        engine.iterate()
        if all(o.finish_reason is not None for o in outs.values()):
            return [outs[r.request_id] for r in reqs]
    raise AssertionError("requests did not finish")


_count = [0]


def req(ids: list[int], seed: int | None = None, n: int = 8, chat: bool = False
        ) -> GenerationRequest:
    _count[0] += 1
    temp = 0.0 if seed is None else 1.0
    params = SamplingParams(temperature=temp, seed=seed, max_tokens=n, ignore_eos=True)
    return GenerationRequest(f"r{_count[0]}", list(ids), params, chat=chat)


def both(on: Engine, off: Engine, reqs: list[list[int]], seed: int | None = None
         ) -> list[Output]:
    """Run prompts in order on both engines; assert identical tokens; the cached outputs."""
    got = []
    for ids in reqs:
        a = run_many(on, [req(ids, seed)])[0]
        b = run_many(off, [req(ids, seed)])[0]
        assert a.token_ids == b.token_ids, (ids[:5], a.token_ids, b.token_ids)
        assert b.cached_tokens == 0
        got.append(a)
    return got


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_a_resent_conversation_hits_and_equals_no_cache(kind: str, seed: int | None,
                                                         tok: Tokenizer) -> None:
    on, off = engines(kind, tok)
    p = tok.encode("ROMEO. What light through yonder window breaks? " * 3)
    first = run_many(on, [req(p, seed)])[0]
    turn2 = p + first.token_ids + tok.encode(" JULIET. Ay me.")
    second = run_many(on, [req(turn2, seed)])[0]
    turn3 = turn2 + second.token_ids + tok.encode(" ROMEO. She speaks.")
    outs = both(on, off, [p, turn2, turn3], seed)
    assert outs[1].cached_tokens >= len(p) + len(first.token_ids) - 1
    assert outs[2].cached_tokens >= len(turn2) + len(second.token_ids) - 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_diverging_inside_a_cached_span(kind: str, tok: Tokenizer) -> None:
    on, off = engines(kind, tok)
    long = tok.encode("Now is the winter of our discontent, made glorious summer. " * 24)
    assert len(long) > 250
    diverged = long[:200] + tok.encode(" But I, that am not shaped for sportive tricks.")
    outs = both(on, off, [long, diverged])
    assert outs[1].cached_tokens == 192  # the interval entry (every 64 tokens) before 200
    again = diverged[:230] + tok.encode(" Deformed, unfinished.")
    assert both(on, off, [again])[0].cached_tokens >= 200  # the branch point, kept by #2


def test_a_short_shared_system_prompt_hits(tok: Tokenizer) -> None:
    on, off = engines("linear", tok)
    system = tok.encode("You are a herald of the court of Denmark.\n\n")
    assert len(system) < 40
    asks = [system + tok.encode(f"User: what news of the {w}?\nAssistant:")
            for w in ("king", "queen", "prince", "army")]
    outs = both(on, off, asks)
    assert outs[0].cached_tokens == 0
    assert all(o.cached_tokens >= len(system) for o in outs[2:])


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_sent_again_whole_runs_only_its_last_token(kind: str, seed: int | None,
                                                            tok: Tokenizer) -> None:
    on, off = engines(kind, tok)
    p = tok.encode("Now is the winter of our discontent made glorious summer. " * 2)
    assert MIN_BRANCH < len(p) < 64  # no interval entry: only the prompt's own entries
    outs = both(on, off, [p, p, p, p], seed)
    # The first copy leaves a state at its end, which cannot start a copy (whose first
    # sample needs the last token's logits); the second keeps one a token short of it.
    assert [o.cached_tokens for o in outs] == [0, 0, len(p) - 1, len(p) - 1]


def test_concurrent_requests_share_one_prefix(tok: Tokenizer) -> None:
    on, off = engines("linear", tok)
    p = tok.encode("Friends, Romans, countrymen, lend me your ears. " * 4)
    run_many(on, [req(p)])
    asks = [p + tok.encode(f" {w}") for w in ("I", "come", "to", "bury")]
    together = run_many(on, [req(a) for a in asks])
    alone = [run_many(off, [req(a)])[0] for a in asks]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(o.cached_tokens >= len(p) for o in together)


def test_evictions_never_change_outputs(tok: Tokenizer) -> None:
    model_bytes = tiny_model("linear", vocab_size=tok.vocab_size).new_state(1).nbytes
    on, off = engines("linear", tok, budget=2 * model_bytes)
    prompts = [tok.encode(f"Scene {i}. Enter the ghost of Hamlet's father. " * 3)
               for i in range(6)]
    both(on, off, prompts + prompts[::-1])
    cache = on.prefix.cache if on.prefix else None
    assert cache is not None and cache.stats.evictions > 0 and cache.bytes <= 2 * model_bytes


def test_a_long_prefills_entries_hold_its_keys_once(tok: Tokenizer) -> None:
    on, off = engines("softmax", tok)
    p = tok.encode("Now is the winter of our discontent made glorious summer. " * 30)
    assert len(p) > 4 * 64  # several interval entries, a chunk of 64 at a time
    run_many(on, [req(p)])
    cache = on.prefix.cache if on.prefix else None
    assert cache is not None
    path = cache.states()  # every 64 tokens, the prompt's end, and after the reply
    assert max(int(st.lengths[0]) for st in path) == len(p) + 7
    buffers = {e.k.untyped_storage().data_ptr() for st in path for e in st.kv_entries}
    assert len(path) >= 6 and len(buffers) == len(path[0].kv_entries)
    held = {k: n for st in path for k, n in memory_parts(st).items()}
    assert sum(held.values()) < sum(st.nbytes for st in path) / 2
    both(on, off, [p, p[:200] + tok.encode(" Enter GLOUCESTER."), p[:130]])


def test_a_prompts_room_for_its_reply_stays_out_of_the_batch(tok: Tokenizer) -> None:
    """The prefill leaves room in its buffers for the reply's keys (the entry after the
    reply writes them there); the batch row copies only what the prompt uses."""
    on, _ = engines("softmax", tok)
    p = tok.encode("To be, or not to be, that is the question.")
    on.submit(req(p, n=900), "long-reply")
    for _ in range(50):
        on.iterate()
        if on.running:
            break
    assert on.running and on.pool.state.kv_entries[0].capacity <= 256
    kept = on.prefix.cache.get(p) if on.prefix else None
    assert kept is not None and kept.kv_entries[0].shared is not None
    assert kept.kv_entries[0].shared.k.shape[2] >= len(p) + 900
