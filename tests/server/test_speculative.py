"""Speculative decoding changes nothing but speed: the engine with drafts (n-gram, a draft
model that agrees, one that does not) against the engine without, on tiny random models of
every state kind, driven iteration by iteration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import loader
from linserve.model.interface import CheckpointError, ServedModel
from linserve.model.sampling import SamplingParams
from linserve.model.state import KVEntry, State
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.types import GenerationRequest, Output
from linserve.server.speculative import draft as draft_mod
from linserve.server.speculative.config import SpeculativeConfig, parse
from tests.model.family_fixtures import make
from tests.model.helpers import served, tiny_model
from tests.paths import ROOT

VOCAB = 97


def run_all(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, Output]:
    """Submit every request at once, iterate until all finish; each one's whole output."""
    outs: dict[str, Output] = {r.request_id: Output() for r in reqs}
    done: set[str] = set()

    def deliver(batch: list[tuple[object, Output]]) -> None:
        for sink, out in batch:
            rid = str(sink)
            outs[rid] = outs[rid].merge(out)
            if out.finish_reason is not None:
                done.add(rid)

    engine.deliver = deliver  # type: ignore[assignment]
    for r in reqs:
        engine.submit(r, r.request_id)  # type: ignore[arg-type]
    for _ in range(2000):
        engine.iterate()
        if len(done) == len(reqs):
            return outs
    raise AssertionError("the requests did not finish")


def prompts(seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """Prompts that repeat themselves (n-gram drafts find matches), of different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 12, 5):
        x = torch.randint(1, vocab, (n,), generator=g).tolist()
        out.append(x + x[:3] + x + x[: n // 2])
    return out


def requests(ps: list[list[int]], params: list[SamplingParams], tag: str
             ) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", p, q, want_state=True)
            for i, (p, q) in enumerate(zip(ps, params, strict=True))]


def spec(method: str, k: int = 3, **extra: object) -> SpeculativeConfig:
    return SpeculativeConfig.model_validate(
        {"method": method, "num_speculative_tokens": k, "adaptive": False, "max_batch": 8,
         **extra})


def engine(model: ServedModel, config: SpeculativeConfig | None = None,
           draft: ServedModel | None = None) -> Engine:
    return Engine(model, EngineLimits(max_running=8), lambda _: None, speculative=config,
                  draft=draft)


def states_close(a: State | None, b: State | None, exact: bool) -> bool:
    assert a is not None and b is not None
    if not torch.equal(a.lengths, b.lengths):
        return False
    for x, y in zip(a.entries(), b.entries(), strict=True):
        pairs = list(zip(x.tensors().values(), y.tensors().values(), strict=True))
        if isinstance(x, KVEntry) and isinstance(y, KVEntry):
            n = int(x.slots_used(a.lengths)[0])
            pairs = [(x.k[:, :, :n], y.k[:, :, :n]), (x.v[:, :, :n], y.v[:, :, :n])]
        for s, t in pairs:
            if exact and not torch.equal(s, t):
                return False
            if not torch.allclose(s, t, atol=1e-4, rtol=1e-4):
                return False
    return True


def same_outputs(model: ServedModel, config: SpeculativeConfig, draft: ServedModel | None,
                 params: list[SamplingParams], exact_state: bool, seed: int = 0,
                 ps: list[list[int]] | None = None) -> Engine:
    """Three requests at once, with and without speculation: the same tokens, finish
    reasons, logprobs and (within fp32 rounding, or bit for bit) session states."""
    ps = ps or prompts(seed, model.info.vocab_size)
    plain = run_all(engine(model), requests(ps, params, "r"))
    eng = engine(model, config, draft)
    fast = run_all(eng, requests(ps, params, "r"))
    for rid, want in plain.items():
        got = fast[rid]
        assert got.token_ids == want.token_ids, rid
        assert got.finish_reason == want.finish_reason, rid
        assert [e.logprob for e in got.logprobs] == pytest.approx(
            [e.logprob for e in want.logprobs], abs=1e-4)
        assert states_close(got.final_state, want.final_state, exact_state), rid
    return eng


GREEDY = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
          for n in (20, 13, 9)]


TEXTS = ["ROMEO. But soft, what light through yonder window breaks? It is the east, and "
         "Juliet is the sun. ROMEO. But soft, what light",
         "KING. Now is the winter of our discontent made glorious summer. KING. Now is",
         "HAMLET. To be, or not to be, that is the question."]


def shipped(name: str) -> ServedModel:
    """A shipped model as served by default (bf16 where the CPU has it, the fused step)."""
    return loader.load(ROOT / "weights" / name)


@pytest.mark.parametrize("name", ["linear", "softmax", "window", "favor"])
@pytest.mark.parametrize("method", ["ngram", "self", "other"])
def test_own_models_greedy_and_states_unchanged(name: str, method: str,
                                                auto_dtype: str) -> None:
    """The shipped models (linear and FAVOR+ states, a KV cache, a sliding window's ring),
    as served by default (each way this CPU resolves ``--dtype auto``): drafts from the
    prompt, from a draft that always agrees (the model itself) and from another model
    (``linear-ungated``)."""
    model = shipped(name)
    other = shipped("linear-ungated")
    config = spec("ngram") if method == "ngram" else spec("draft_model", model="x")
    draft = {"ngram": None, "self": model, "other": other}[method]
    tok = model.tokenizer()
    eng = same_outputs(model, config, draft, GREEDY, exact_state=True,
                       ps=[tok.encode(t) for t in TEXTS])
    assert eng.spec is not None and eng.spec.drafted > 0
    if method == "self":  # a draft that agrees: every draft kept
        assert eng.spec.accepted == eng.spec.drafted
    else:
        assert eng.spec.accepted < eng.spec.drafted


@pytest.mark.parametrize("family,shape", [("qwen3_5", "i4-tied"), ("lfm2", "a2-tied"),
                                          ("granitemoehybrid", "rope-g2"),
                                          ("kimi_linear", "plain-q"), ("mamba", "tied-r4"),
                                          ("minimax", "b16-tied"), ("olmo_hybrid", "rope-neg"),
                                          ("lfm3", "w16-gate-sandwich")])
def test_hf_families_greedy_unchanged(family: str, shape: str, tmp_path: Path) -> None:
    """Gated DeltaNet (Qwen's and OLMo's), short convolutions, Mamba2, KDA with MLA, Mamba,
    lightning attention, a sliding window's ring (verified by steps): the same greedy tokens
    and the same states, bit for bit (in bf16 too)."""
    path = make(tmp_path, family, shape)
    model = loader.load(path, "bfloat16")
    other = loader.load(make(tmp_path / "draft", family, shape, seed=3), "bfloat16")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 7)]
    for config, draft in ((spec("ngram", 4), None), (spec("draft_model", 2, model="x"), other)):
        ps = prompts(1, 500)[:2]
        plain = run_all(engine(model), requests(ps, params, "h"))
        eng = engine(model, config, draft)
        fast = run_all(eng, requests(ps, params, "h"))
        assert eng.spec is not None and (draft is None or eng.spec.drafted > 0)
        for rid, want in plain.items():
            assert fast[rid].token_ids == want.token_ids
            assert states_close(fast[rid].final_state, want.final_state, exact=True)


def test_seeded_sampling_is_the_same_under_every_option() -> None:
    """A seeded request samples the very tokens it samples without speculation, with
    top-p, top-k, min-p, the penalties and a logit bias (each position sampled from the
    logits plain decoding would have there, after the same processors)."""
    model = served(tiny_model("linear"))
    params = [SamplingParams(temperature=0.9, top_p=0.8, max_tokens=24, seed=11,
                             ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=1.2, top_k=5, min_p=0.05, max_tokens=18, seed=3,
                             ignore_eos=True, frequency_penalty=0.3, repetition_penalty=1.2,
                             logit_bias=((5, 3.0),)),
              SamplingParams(temperature=0.7, max_tokens=30, seed=5, ignore_eos=True)]
    me = served(tiny_model("linear"))
    same_outputs(model, spec("draft_model", 4, model="x"), me, params, exact_state=True)
    same_outputs(model, spec("ngram", 4), None, params, exact_state=True, seed=4)


def test_stops_end_where_plain_decoding_ends() -> None:
    """An EOS id, a stop string and max_tokens inside a draft: nothing past them is sent."""
    model = served(tiny_model("linear"))
    ps = prompts(2)
    base = run_all(engine(model), requests(
        ps, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3, "s"))
    eos = base["s0"].token_ids[6]
    stop = model.tokenizer().decode(base["s1"].token_ids[:8])[-3:]
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(eos,),
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]

    def reqs() -> list[GenerationRequest]:
        out = requests(ps, params, "s")
        out[1].stop = (stop,)
        return out

    want = run_all(engine(model), reqs())
    got = run_all(engine(model, spec("draft_model", 4, model="x"), model), reqs())
    for rid in want:
        assert got[rid].token_ids == want[rid].token_ids
        assert got[rid].text == want[rid].text
        assert got[rid].finish_reason == want[rid].finish_reason
    assert len(want["s2"].token_ids) == 5 and want["s0"].finish_reason == "stop"


def test_acceptance_is_counted() -> None:
    model = served(tiny_model("linear"))
    eng = engine(model, spec("draft_model", 3, model="x"), model)
    ps = prompts(3)
    run_all(eng, requests(ps[:1], GREEDY[:1], "m"))
    assert eng.spec is not None
    # 20 tokens: the first from the prompt, four verifies of 3 drafts kept whole (4 tokens
    # each), then 2 drafts (no draft past max_tokens)
    assert eng.spec.accepted == eng.spec.drafted == 14 and eng.spec.verifies == 5


def _pair_distribution(model: ServedModel, prompt: list[int], params: SamplingParams
                       ) -> torch.Tensor:
    """The exact p(t2, t3) of the 2nd and 3rd tokens sampled with ``params`` after
    ``prompt``, summed over the first: ``[V, V]``."""
    from linserve.model.sampling import BatchParams, sampling_probs
    bp = BatchParams.from_params([params])

    def dist(logits: torch.Tensor) -> torch.Tensor:
        p = sampling_probs(logits, bp)[0]
        return p / p.sum()

    first, state = model.prefill(torch.tensor([prompt]))
    p1 = dist(first)
    v = p1.shape[0]
    joint = torch.zeros(v, v)
    for t1 in range(v):
        s1 = state.copy()
        p2 = dist(model.step(torch.tensor([t1]), s1))
        for t2 in range(v):
            p3 = dist(model.step(torch.tensor([t2]), s1.copy()))
            joint[t2] += p1[t1] * p2[t2] * p3
    return joint


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_tokens_keep_the_model_distribution(top_p: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Goodness of fit of the 2nd and 3rd tokens (a verify's positions 0 and 1) over many
    seeds, with a draft that disagrees often, against the model's exact distribution (with
    top-p too); the same test rejects a verifier that keeps every draft."""
    from dataclasses import replace

    from scipy.stats import chisquare

    from linserve.server.engine import speculation

    model = served(tiny_model("linear", vocab_size=8))
    draft = served(tiny_model("linear", seed=5, vocab_size=8))
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, ignore_eos=True)
    joint = _pair_distribution(model, prompt, params)

    def chi2_p(n: int) -> float:
        eng = engine(model, spec("draft_model", 2, model="x"), draft)
        counts = torch.zeros(8, 8)
        for i in range(0, n, 8):
            batch = [GenerationRequest(f"d{j}", prompt, replace(params, seed=j))
                     for j in range(i, i + 8)]
            for out in run_all(eng, batch).values():
                counts[out.token_ids[1], out.token_ids[2]] += 1
        assert eng.spec is not None and eng.spec.drafted > 0
        expected = joint.flatten() * n
        keep = expected >= 5
        obs, exp = counts.flatten()[keep], expected[keep]
        return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)

    assert chi2_p(800) > 1e-3

    def keep_every_draft(self: speculation.Speculator, rows: list[speculation.Row],
                         logits: list[torch.Tensor]) -> None:
        for r, row in enumerate(rows):  # the drafts taken as they are, then one sample
            for tok in row.feed[1:]:
                row.seq.add_token(tok, None)
            slot = torch.tensor([row.slot])
            self.sampler.sample_slots([row.seq], logits[r][-1:], slot)
            row.fed = len(row.feed)

    monkeypatch.setattr(speculation.Speculator, "_accept", keep_every_draft)
    assert chi2_p(800) < 1e-3


def test_config_errors_are_one_line() -> None:
    assert parse("") is None
    for bad, words in [("{", "not JSON"), ("[]", "JSON object"),
                       ('{"method": "x", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "bogus"),
                       ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
                       ('{"method": "mtp", "num_speculative_tokens": 1, "model": "x"}',
                        "draft_model"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, '
                        '"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=words) as info:
            parse(bad)
        assert "\n" not in str(info.value)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    ok = draft_mod.check_draft(spec("draft_model", model=str(ROOT / "weights/linear-ungated")),
                               ROOT / "weights" / "linear")
    assert ok.name == "linear-ungated"
    from tests.model.qwen_fixtures import make_checkpoint
    qwen = make_checkpoint(tmp_path, "i4-tied")
    with pytest.raises(CheckpointError, match="another vocabulary"):
        draft_mod.check_draft(spec("draft_model", model=str(qwen)), ROOT / "weights" / "linear")


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    from linserve.server.speculative.proposers import ngram_lookup
    h = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(h, 3, 3, 1) == [4, 5, 9]  # "1 2 3" matched, not the later "2 3"
    assert ngram_lookup(h, 2, 2, 1) == [7, 8]  # "2 3": its latest occurrence
    assert ngram_lookup([5, 6, 7], 3, 3, 1) == []
    assert ngram_lookup([4, 4], 3, 2, 1) == [4]


def test_draft_length_follows_acceptance_and_cost() -> None:
    from linserve.server.speculative.acceptance import (
        CostModel,
        DraftBudget,
        best_length,
        expected_tokens,
    )
    assert expected_tokens([0.0] * 3) == 1.0 and expected_tokens([1.0] * 3) == 4.0
    assert expected_tokens([0.5, 0.5]) == 1.75
    assert best_length([0.9] * 4, lambda k: 1.0 + 0.05 * k) == 4
    assert best_length([0.1] * 4, lambda k: 1.0 + 0.05 * k) == 0  # drafts do not pay
    assert best_length([0.9] * 4, lambda k: 12.0) == 0  # a verify costs 12 steps (tiny models)
    # An MTP layer's drafts (§63): the third is kept 31% of the time and costs more than
    # it gives, so two are drafted, where one rate for all positions (0.67) drafted three.
    assert best_length([0.92, 0.77, 0.31], lambda k: 1.0 + 0.25 * k) == 2
    costs = CostModel()
    costs.note_step(1, 0.01)
    for t in range(1, 6):
        costs.note_verify(t, 0.012 + 0.001 * t)
    budget = DraftBudget(4, costs)
    for _ in range(10):
        budget.record("a", 4, 4)
        budget.record("b", 4, 0)
    assert budget.length("a", 10) == 4
    assert budget.length("a", 2) == 2  # no draft past max_tokens
    assert [budget.length("b", 10) for _ in range(8)] == [0] * 7 + [1]  # probed now and then
    for _ in range(10):  # "c" keeps its first two drafts and never a third
        budget.record("c", 4, 2)
    rates = budget.rates("c")
    assert rates[0] > 0.85 and rates[1] > 0.85 and rates[2] < 0.2
    assert budget.length("c", 10) == 2
    assert budget.rates("new") == pytest.approx(budget.everyone.rates(None, 2.0))
    fresh = DraftBudget(3, costs)  # a position never tried inherits the one before's rate
    for _ in range(10):
        fresh.record("d", 1, 1)
    assert fresh.rates("d")[1] == pytest.approx(fresh.rates("d")[0], rel=0.1)
    assert fresh.length("d", 10) >= 2
    # one more than the best now and then: a position refused at first is tried again
    for _ in range(10):
        fresh.record("e", 2, 1)
    assert [fresh.length("e", 10) for _ in range(8)] == [1] * 7 + [2]


def test_cost_model_reads_medians_and_lines_between_sizes() -> None:
    """One slow call does not stick to a size (a verify of 3 timed once at 8x its cost was
    never drafted again, §65); a size never timed lies on the line through its neighbours;
    with MTP, drafting none is a verify of one token, which is what drafts must beat."""
    from linserve.server.speculative.acceptance import CostModel, DraftBudget
    costs = CostModel()
    costs.note_step(1, 0.010)
    for seconds in (0.080, 0.012, 0.0121):  # the first call of a shape, then two usual ones
        costs.note_verify(3, seconds)
    assert costs.verify_seconds(3) == pytest.approx(0.0121)
    costs.note_verify(2, 0.011)
    assert costs.verify_seconds(4) == pytest.approx(0.0132)  # on the line through 2 and 3
    assert costs.verify_seconds(1) == pytest.approx(0.011)  # never below the nearest
    costs.note_draft(2, 0.002)
    costs.note_draft(1, 0.050)
    costs.note_draft(3, 0.003)
    assert costs.draft_token == pytest.approx(0.001)
    costs.note_verify(1, 0.0105)
    plain = DraftBudget(2, costs)
    mtp = DraftBudget(2, costs, plain_is_verify=True)
    assert plain._relative_cost(1) == pytest.approx((0.011 + 0.001) / 0.010)
    assert mtp._relative_cost(1) == pytest.approx((0.011 + 0.001) / 0.0105)


@pytest.mark.parametrize("family,dtype", [("qwen3_5", "float32"), ("qwen3_5", "bfloat16"),
                                          ("qwen3_5_moe", "bfloat16"),
                                          ("qwen3_next", "bfloat16")])
def test_mtp_drafts_change_nothing(family: str, dtype: str, tmp_path: Path) -> None:
    """The checkpoint's MTP layer drafts (from the verify's hidden states): the same greedy
    and seeded tokens and states as without speculation (Qwen3.5, its MoE, Qwen3-Next)."""
    from tests.model.qwen_fixtures import add_mtp, make_checkpoint
    shapes = {"qwen3_5_moe": "e8k2-tied", "qwen3_next": "e6k2-step2"}
    path = (make_checkpoint(tmp_path, "i4-tied", tokenizer="project") if family == "qwen3_5"
            else make(tmp_path, family, shapes[family]))
    model = loader.load(add_mtp(path), dtype)
    assert model.draft_head() is not None and "1 MTP layer" in model.info.architecture
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)]
    eng = same_outputs(model, spec("mtp", 3), None, params + params[:1], exact_state=True)
    assert eng.spec is not None and eng.spec.drafted > 0


def test_mtp_needs_mtp_layers(tmp_path: Path) -> None:
    from tests.model.qwen_fixtures import make_checkpoint
    path = make_checkpoint(tmp_path, "i4-tied", tokenizer="project")
    with pytest.raises(CheckpointError, match="no MTP layers"):
        draft_mod.check_speculative(spec("mtp"), path)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_grammars_hold_under_speculation(method: str) -> None:
    """A regex and a JSON schema: each verified position masked as plain decoding masks it,
    greedy and seeded, ending where plain decoding ends."""
    from dataclasses import replace

    from linserve.server.grammar.spec import GrammarSpec
    model = shipped("linear")
    tok = model.tokenizer()
    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    grammars = [GrammarSpec("regex", "(ROMEO|JULIET)\\. [A-Za-z ,]{5,60}\\.", "guided_regex"),
                GrammarSpec("json_schema", schema, "guided_json"),
                GrammarSpec("regex", "[a-z ]{3,40}", "guided_regex")]
    params = [SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.9, max_tokens=30, seed=5),
              SamplingParams(temperature=0.0, max_tokens=20)]
    ps = [tok.encode(t) for t in TEXTS]

    def reqs() -> list[GenerationRequest]:
        return [replace(r, grammar=g) for r, g in zip(requests(ps, params, "g"), grammars,
                                                       strict=True)]

    want = run_all(engine(model), reqs())
    config = spec("ngram") if method == "ngram" else spec("draft_model", model="x")
    got = run_all(engine(model, config, model if method == "self" else None), reqs())
    for rid in want:
        assert got[rid].token_ids == want[rid].token_ids
        assert got[rid].finish_reason == want[rid].finish_reason != "error"


def test_seeded_requests_are_the_same_alone_and_under_load() -> None:
    """Alone a seeded request is verified in drafts; among eight (above max_batch 4) it is
    stepped plainly part of the time: the same tokens either way."""
    model = shipped("linear")
    tok = model.tokenizer()
    config = SpeculativeConfig.model_validate(
        {"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "max_batch": 4,
         "adaptive": False})
    other = shipped("linear-ungated")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=42)
    prompt = tok.encode(TEXTS[0])
    alone = run_all(engine(model, config, other), [GenerationRequest("a", prompt, params)])
    crowd = [GenerationRequest("a", prompt, params)] + [
        GenerationRequest(f"o{i}", [*tok.encode(TEXTS[i % 3]), i + 5],
                          SamplingParams(temperature=1.0, max_tokens=10 + 3 * i, seed=i))
        for i in range(7)]
    eng = engine(model, config, other)
    loaded = run_all(eng, crowd)
    assert loaded["a"].token_ids == alone["a"].token_ids
    assert eng.spec is not None and eng.spec.drafted > 0
