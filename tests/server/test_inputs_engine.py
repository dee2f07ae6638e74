"""The input seam for what is not a token (:mod:`linserve.model.inputs`), with a test encoder
whose item embeddings are the token embeddings of ids it is sent: such an item answers
exactly as the same ids as text; a prompt split inside an item answers as whole; the engine
encodes an item once, keys the prefix cache by its content (two items on the same
placeholder tokens are never confused), and a model without an encoder of the kind says so."""

from __future__ import annotations

import array
from pathlib import Path

import pytest
import torch

from linserve.model import loader
from linserve.model.inputs import Insert, InsertTable, digest_of, mark, virtual_ids
from linserve.model.sampling import SamplingParams
from linserve.model.served import ServedModule
from linserve.server.engine.engine import Engine, EngineLimits
from linserve.server.engine.types import GenerationRequest, Output
from tests.model.family_fixtures import VOCAB, make

pytest.importorskip("transformers")


class TokenEncoder:
    """Items whose payload is int32 token ids; their embeddings are those tokens' rows."""

    def __init__(self, model: ServedModule) -> None:
        self.model, self.calls = model, 0

    def encode(self, item: Insert) -> torch.Tensor:
        self.calls += 1
        ids = torch.tensor(array.array("i", item.payload).tolist())
        return self.model.module.embed(ids[None])[0]


def item(start: int, ids: list[int], kind: str = "test") -> Insert:
    payload = array.array("i", ids).tobytes()
    return Insert(kind, start, len(ids), digest_of(payload), payload)


@pytest.fixture(scope="module", params=[("lfm2", "a2-tied"), ("qwen3_5", "i4-tied")],
                ids=lambda p: p[0])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> ServedModule:
    family, shape = request.param
    served = loader.load(make(tmp_path_factory.mktemp(family), family, shape), "float32")
    assert isinstance(served, ServedModule)
    served.add_encoder("test", TokenEncoder(served))
    return served


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _table(model: ServedModule, items: list[Insert]) -> InsertTable:
    table = InsertTable()
    for it in items:
        table.add(it, model.encoders()["test"].encode(it))
    return table


def test_virtual_ids_are_negative_distinct_and_checked() -> None:
    a, b = virtual_ids(digest_of(b"a"), 5), virtual_ids(digest_of(b"b"), 5)
    assert all(t < 0 for t in a + b) and len(set(a + b)) == 10
    assert mark([1, 2, 3, 4], [item(1, [7, 8])])[0::3] == [1, 4]
    with pytest.raises(ValueError, match="does not fit"):
        mark([1, 2, 3], [item(2, [7, 8])])
    with pytest.raises(ValueError, match="does not fit"):
        mark([1, 2, 3, 4, 5], [item(0, [7, 8]), item(1, [7, 8])])


def test_an_item_of_token_embeddings_answers_as_its_text(model: ServedModule) -> None:
    text = _ids(1, 30)
    it = item(9, text[9:17])
    logits, _ = model.prefill(torch.tensor([mark(text, [it])]), all_logits=True,
                              inserts=_table(model, [it]))
    want, _ = model.prefill(torch.tensor([text]), all_logits=True)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_a_prompt_split_inside_an_item_answers_as_whole(model: ServedModule) -> None:
    text = _ids(2, 40)
    items = [item(5, _ids(3, 12)), item(25, _ids(4, 6))]
    ids, table = mark(text, items), _table(model, items)
    whole, _ = model.prefill(torch.tensor([ids]), inserts=table)
    _, state = model.prefill(torch.tensor([ids[:11]]), inserts=table)
    _, state = model.prefill(torch.tensor([ids[11:28]]), state, inserts=table)
    split, _ = model.prefill(torch.tensor([ids[28:]]), state, inserts=table)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="was not sent"):
        model.prefill(torch.tensor([ids]))  # virtual ids without their embeddings


def _run(engine: Engine, req: GenerationRequest) -> Output:
    out = [Output()]
    engine.deliver = lambda batch: [out.__setitem__(0, out[0].merge(o))  # type: ignore[func-returns-value]
                                    for _, o in batch]
    engine.submit(req, req.request_id)
    for _ in range(500):
        engine.iterate()
        if out[0].finish_reason is not None:
            return out[0]
    raise AssertionError("the request did not finish")


_count = [0]


def _req(text: list[int], items: list[Insert]) -> GenerationRequest:
    _count[0] += 1
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return GenerationRequest(f"r{_count[0]}", mark(text, items), params,
                             inserts=tuple(items))


def test_the_engine_encodes_once_and_caches_by_content(model: ServedModule) -> None:
    """The same item again: encoded once, its prompt served from the prefix cache past the
    item, the same tokens. Another item on the same positions: never served from the
    first's entries, and its tokens are those of an engine without a cache."""
    limits = dict(max_running=4, prefill_chunk=16, step_token_budget=64,
                  prefix_cache_interval=16)
    on = Engine(model, EngineLimits(prefix_cache_bytes=1 << 28, **limits), lambda _: None)
    off = Engine(model, EngineLimits(prefix_cache_bytes=0, **limits), lambda _: None)
    encoder = model.encoders()["test"]
    assert isinstance(encoder, TokenEncoder)
    text = _ids(5, 48)
    first = item(4, _ids(6, 20))
    other = item(4, [*_ids(6, 19), 11])  # one position differs
    calls = encoder.calls
    a = _run(on, _req(text, [first]))
    again = _run(on, _req(text, [first]))
    assert encoder.calls == calls + 1 and again.token_ids == a.token_ids
    assert again.cached_tokens >= first.end and a.cached_tokens == 0
    b = _run(on, _req(text, [other]))
    assert b.cached_tokens <= other.start
    assert b.token_ids == _run(off, _req(text, [other])).token_ids
    as_text = GenerationRequest("plain", text[:4] + _ids(6, 20) + text[24:],
                                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert _run(off, as_text).token_ids == a.token_ids  # the item is its tokens' embeddings


def test_a_model_without_the_encoder_fails_the_request_alone(tmp_path: Path) -> None:
    plain = loader.load(make(tmp_path, "lfm2", "a2-tied"), "float32")
    engine = Engine(plain, EngineLimits(max_running=2), lambda _: None)
    out = _run(engine, _req(_ids(7, 20), [item(3, [1, 2, 3], kind="image")]))
    assert out.finish_reason == "error" and out.error is not None
    assert "takes no image input" in out.error
    ok = _run(engine, GenerationRequest("fine", _ids(8, 10), SamplingParams(max_tokens=2)))
    assert ok.finish_reason == "length"
