"""Structured outputs on tiny random models: request fields → one spec, compiled once and
cached, masks that only let grammar tokens through (both samplers), and an engine whose
constrained rows follow their grammar inside a mixed batch, with ``stop`` on completion."""

from __future__ import annotations

import json
import re

import pytest
import torch

from linserve.model.sampling import BatchParams, SamplingParams, TokenMask, make_generator, sample
from linserve.model.tokenizer import Tokenizer
from linserve.server.api.protocol import ChatRequest, CompletionRequest
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.grammar.compiler import GrammarCompiler
from linserve.server.grammar.masks import MaskBuilder
from linserve.server.grammar.spec import GrammarError, GrammarSpec, from_request
from tests.model.helpers import served, tiny_model

SCHEMA = {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0,
                                                       "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["word", "n", "ok"], "additionalProperties": False}



@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size)


def spec_of(body: dict[str, object], chat: bool = False) -> GrammarSpec | None:
    if chat:
        return ChatRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **body}).grammar_spec()
    return CompletionRequest.model_validate({"prompt": "x", **body}).grammar_spec()


def test_every_request_field_becomes_one_spec() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    s = spec_of({"response_format": rf}, chat=True)
    assert s is not None and s.kind == "json_schema" and json.loads(s.source) == SCHEMA
    assert s.param == "response_format.json_schema.schema"
    assert list(json.loads(s.source)["properties"]) == ["word", "n", "ok"]  # order kept
    s = spec_of({"response_format": {"type": "json_object"}})
    assert s is not None and s.kind == "json_object"
    assert spec_of({"response_format": {"type": "text"}}) is None
    s = spec_of({"guided_json": json.dumps(SCHEMA)})
    assert s is not None and json.loads(s.source) == SCHEMA
    s = spec_of({"structured_outputs": {"choice": ["a", "b"]}})
    assert s is not None and s.kind == "choice" and s.param == "structured_outputs.choice"
    s = spec_of({"guided_regex": "[0-9]+", "guided_whitespace_pattern": " ?"})
    assert s is not None and s.kind == "regex"
    with pytest.raises(GrammarError, match="one output constraint"):
        spec_of({"guided_regex": "a", "structured_outputs": {"json_object": True}})
    with pytest.raises(GrammarError, match="not valid JSON"):
        from_request(None, {"guided_json": "{nope"})


def test_compiled_once_then_cached(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), "guided_json")
    misses = compiler.misses
    a = compiler.matcher(spec)
    b = compiler.matcher(spec)
    assert compiler.misses == misses + 1 and compiler.hits >= 1
    assert a is not b  # each request gets its own copy of the template
    assert a.consume_token(compiler.tokenizer.tokenize_str("{")[0])
    assert not b.is_error()


@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec("json_schema", '{"type": "foo"}', "guided_json"), "Invalid type: foo"),
    (GrammarSpec("json_schema", '{"not": {}}', "guided_json"), "Unimplemented keys"),
    (GrammarSpec("regex", "[a-", "guided_regex"), "unclosed character class"),
    (GrammarSpec("grammar", "start: missing", "guided_grammar"), "unknown name"),
])
def test_invalid_grammars_say_what_is_wrong(compiler: GrammarCompiler, spec: GrammarSpec,
                                            message: str) -> None:
    with pytest.raises(GrammarError, match=message) as err:
        compiler.template(spec)
    assert err.value.param == spec.param
    misses = compiler.misses
    with pytest.raises(GrammarError, match=message):  # cached: no second compile
        compiler.template(spec)
    assert compiler.misses == misses


@pytest.mark.parametrize("native", [True, False])
def test_mask_lets_only_allowed_tokens_through(native: bool) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    bits = torch.full((4, 2), -1, dtype=torch.int32)
    bits[1] = torch.tensor([(1 << 3) | (1 << 7), 0], dtype=torch.int32)
    bits[3] = torch.tensor([1 << 11, 0], dtype=torch.int32)
    mask = TokenMask(bits, torch.tensor([1, 3]))
    assert mask.allowed(50).sum(-1).tolist() == [2, 1]
    params = [SamplingParams(temperature=t, logit_bias=((5, 100.0),)) for t in (1.0, 0.0) * 2]
    bp = BatchParams.from_params(params)
    for seed in range(20):
        gens = [make_generator(seed + i) for i in range(4)]
        out = sample(logits, bp, gens, native=native, mask=mask)
        assert int(out[1]) in (3, 7) and int(out[3]) == 11  # the +100 bias cannot lift it
        assert int(out[0]) == 5 or int(out[2]) == 5


@pytest.mark.parametrize("native", [True, False])
def test_a_bias_that_bans_every_allowed_token_yields_to_the_grammar(native: bool) -> None:
    logits = torch.randn(2, 64)
    bits = torch.full((2, 2), -1, dtype=torch.int32)
    bits[0] = torch.tensor([(1 << 4) | (1 << 9), 0], dtype=torch.int32)
    mask = TokenMask(bits, torch.tensor([0]))
    params = [SamplingParams(temperature=t, top_p=p, logit_bias=((4, -100.0), (9, -100.0)))
              for t, p in ((1.0, 1.0), (0.0, 1.0))]
    for top_p in (1.0, 0.5):
        params[0] = SamplingParams(temperature=1.0, top_p=top_p,
                                   logit_bias=((4, -100.0), (9, -100.0)))
        bp = BatchParams.from_params(params)
        for seed in range(10):
            out = sample(logits, bp, [make_generator(seed), make_generator(0)], native=native,
                         mask=mask)
            assert int(out[0]) in (4, 9)
            assert int(out[1]) not in (4, 9)  # the unconstrained row keeps its ban


def test_an_underflowing_repetition_penalty_keeps_the_mask() -> None:
    """repetition_penalty 1e-300 is 0 in fp32: dividing a seen token's logit by it gave +inf,
    then NaN probabilities in the top-k path, and a token outside the grammar."""
    logits = torch.full((1, 64), 1.0)
    bits = torch.tensor([[1 << 4, 0]], dtype=torch.int32)
    seen = torch.ones(1, 64, dtype=torch.bool)
    counts = torch.zeros(1, 64)
    mask = TokenMask(bits, torch.tensor([0]))
    bp = BatchParams.from_params([SamplingParams(temperature=1.0, top_k=5,
                                                 repetition_penalty=1e-300)])
    for seed in range(5):
        out = sample(logits, bp, [make_generator(seed)], counts, seen, native=False, mask=mask)
        assert int(out[0]) == 4


def test_mask_builder_marks_dead_ends(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    done = compiler.matcher(GrammarSpec("choice", '["yes"]', "guided_choice"))
    for t in tok.encode("yes"):
        assert done.consume_token(t)
    assert done.is_accepting()
    fresh = compiler.matcher(GrammarSpec("regex", "[0-9]+", "guided_regex"))
    broken = compiler.matcher(GrammarSpec("regex", "[0-9]+", "guided_regex"))
    assert not broken.consume_token(tok.encode("x")[0]) and broken.is_error()
    mask, dead = MaskBuilder(tok.vocab_size).build([None, fresh, done, broken])
    assert mask is not None and mask.rows.tolist() == [1, 2]
    allowed = mask.allowed(tok.vocab_size)
    digits = {i for i in range(tok.vocab_size) if tok.decode([i]).isdigit()}
    assert set(allowed[0].nonzero().flatten().tolist()) == digits
    assert allowed[1].nonzero().flatten().tolist() == [tok.eos_id]  # only the end
    assert dead == [3]
    assert bool((mask.bits[[0, 3]] == -1).all())  # free and dead rows stay open


def run_batch(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, Output]:
    outs: dict[str, Output] = {r.request_id: Output() for r in reqs}
    sinks = {}
    for r in reqs:
        def sink(o: Output, rid: str = r.request_id) -> None:
            outs[rid] = outs[rid].merge(o)
        sinks[r.request_id] = sink
    engine.deliver = lambda batch: [s(o) for s, o in batch]  # type: ignore[func-returns-value]
    for r in reqs:
        engine.submit(r, sinks[r.request_id])
    for _ in range(400):
        engine.iterate()
        if all(o.finish_reason is not None for o in outs.values()):
            return outs
    raise AssertionError("the batch did not finish")


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_engine_constrains_its_rows_in_a_mixed_batch(kind: str, tok: Tokenizer) -> None:
    torch.manual_seed(0)
    engine = Engine(served(tiny_model(kind, vocab_size=tok.vocab_size, max_context=4096), tok),
                    EngineLimits(), deliver=lambda _: None)
    prompt = tok.encode("ROMEO.\n")
    specs = [GrammarSpec("json_schema", json.dumps(SCHEMA), "guided_json"),
             GrammarSpec("regex", "(to be|not to be), [a-z]{1,8}!", "guided_regex"),
             GrammarSpec("choice", '["ay", "nay", "perchance"]', "guided_choice"), None]
    reqs = [GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=80, seed=i,
                                                              ignore_eos=spec is None),
                              grammar=spec) for i, spec in enumerate(specs)]
    outs = run_batch(engine, reqs)
    doc = json.loads(outs["r0"].text)
    assert set(doc) == {"word", "n", "ok"} and 0 <= doc["n"] <= 99
    assert re.fullmatch(r"(to be|not to be), [a-z]{1,8}!", outs["r1"].text)
    assert outs["r2"].text in ("ay", "nay", "perchance")
    assert [outs[f"r{i}"].finish_reason for i in range(3)] == ["stop"] * 3
    assert outs["r3"].finish_reason == "length" and outs["r3"].completion_tokens == 80
