"""RWKV-7 against BlinkDL's reference (the ``rwkv`` package on the same ``.pth``, in fp32):
one set of random weights written as BlinkDL's ``.pth``, as fla-hub's folder and as the GGUF
file llama.cpp's converter makes of that folder, so that one reference checks all three
loaders. Logits of every prompt position and of later steps within
1e-4, the state after them (S in BlinkDL's orientation, both shifts), greedy continuations
identical; the native step against the eager one, prompt splits, batch invariance, bf16;
the world tokenizer against the reference's on every byte and non-ASCII text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from linserve.model import kernels, loader
from linserve.model.interface import CheckpointError
from linserve.model.served import ServedModule
from linserve.model.state import State
from tests.model import rwkv_fixtures
from tests.model.gguf_fixtures import convert

PROMPT = [1, 2, 3, 400, 3000, 17, 17, 255, 256, 1024, 98, 7]


@pytest.fixture(scope="module", params=sorted(rwkv_fixtures.SHAPES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    """A shape's ``.pth``, its fla folder, and the reference on a prompt then our greedy
    continuation (fed to it one token at a time)."""
    shape = request.param
    tmp = tmp_path_factory.mktemp(shape)
    pth = rwkv_fixtures.write_pth(tmp / "pth", shape)
    fla = rwkv_fixtures.write_fla(tmp / "fla", pth)
    gguf = convert(fla, tmp / "model.gguf", "f32", pre=None)
    ours = _served(pth)
    logits, state = ours.module.prefill(torch.tensor([PROMPT]))
    greedy = []
    for _ in range(6):
        greedy.append(int(logits[0].argmax()))
        logits = ours.module.step(torch.tensor(greedy[-1:]), state)
    ref = rwkv_fixtures.reference(pth, PROMPT, greedy, tmp)
    return {"shape": shape, "pth": pth, "fla": fla, "gguf": gguf, "greedy": greedy,
            "ref": ref}


def _served(path: Path, dtype: str = "float32") -> ServedModule:
    model = loader.load(path, dtype)
    assert isinstance(model, ServedModule)
    return model


@pytest.mark.parametrize("layout", ["pth", "fla", "gguf"])
def test_logits_and_state_are_the_references(case: dict[str, Any], layout: str) -> None:
    model = _served(case[layout])
    assert model.info.architecture.startswith("rwkv7")
    ref = case["ref"]
    n = len(PROMPT)
    logits, state = model.module.prefill(torch.tensor([PROMPT]), all_logits=True)
    assert (logits[0] - ref["logits"][:n]).abs().max().item() <= 1e-4
    for i, token in enumerate(case["greedy"]):
        step = model.module.step(torch.tensor([token]), state)
        assert (step[0] - ref["logits"][n + i]).abs().max().item() <= 1e-4
    for i, entries in enumerate(state.layers):  # the reference's [att shift, S, ffn shift]
        ours = [entries["conv"].window[0, 0], entries["recurrent"].s[0],
                entries["ffn"].window[0, 0]]
        for a, b in zip(ours, ref["state"][3 * i : 3 * i + 3], strict=True):
            assert (a - b).abs().max().item() <= 1e-4


def test_greedy_continuation_is_the_references(case: dict[str, Any]) -> None:
    """Each greedy token is the reference's argmax after the tokens before it."""
    ref = case["ref"]["logits"]
    n = len(PROMPT)
    picks = [int(ref[n - 1].argmax())] + [int(ref[n + i].argmax())
                                          for i in range(len(case["greedy"]) - 1)]
    assert picks == case["greedy"]


def test_native_step_splits_and_batch(case: dict[str, Any]) -> None:
    """The native step is the whole model in one call and agrees with the eager step; a
    prompt prefilled whole, in two chunks or token by token ends in the same state and
    logits; a row stepped beside others is the same bits as alone."""
    if not kernels.load():
        pytest.skip("native kernels unavailable")
    model = _served(case["pth"])
    module = model.module
    assert model.info.decode_step.startswith("fused") and module.native_plan() is not None
    whole, state = module.prefill(torch.tensor([PROMPT]))
    _, half = module.prefill(torch.tensor([PROMPT[:5]]))
    split, half = module.prefill(torch.tensor([PROMPT[5:]]), half)
    steps = module.new_state(1)
    for token in PROMPT:
        by_steps = module.step(torch.tensor([token]), steps)
    for other in (split, by_steps):
        assert (other - whole).abs().max().item() <= 1e-5
    eager = state.copy()
    for token in (5, 6, 7):
        a = module.step(torch.tensor([token]), state)
        b = module.step_eager(torch.tensor([token]), eager)
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    rows = [module.prefill(torch.tensor([PROMPT[:n]]))[1] for n in (3, 7, 12)]
    together = module.step(torch.tensor([9, 9, 9]), State.cat([r.copy() for r in rows]))
    for i, row in enumerate(rows):
        assert torch.equal(module.step(torch.tensor([9]), row)[0], together[i])


def test_bf16_tracks_fp32(case: dict[str, Any]) -> None:
    exact = _served(case["pth"]).module.prefill(torch.tensor([PROMPT]), all_logits=True)[0]
    half = _served(case["pth"], "bfloat16").module.prefill(torch.tensor([PROMPT]),
                                                           all_logits=True)[0]
    p = torch.log_softmax(exact[0], -1)
    q = torch.log_softmax(half[0].float(), -1)
    assert (p.exp() * (p - q)).sum(-1).max().item() <= 1e-2


def test_the_world_tokenizer_is_the_references() -> None:
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    from linserve.model.world_tokenizer import WORLD_VOCAB, WorldTokenizer

    ref = TRIE_TOKENIZER(str(WORLD_VOCAB))
    ours = WorldTokenizer.from_file(size=65536)
    rng = random.Random(4)
    texts = ["User: hello\n\nAssistant: 你好，世界 🤖 café naïve", "\t\tdef f():\n\t\treturn 1",
             " " * 300 + "#" * 90, "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(3000))]
    for text in texts:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ours.encode(text)) == text
    every = bytes(range(256)) + bytes(rng.randrange(256) for _ in range(4000))
    assert ours.encode_bytes(every) == ref.encodeBytes(every)
    assert ours.eos_ids == (0,) and ours.token_bytes[0] == b""


def test_the_gguf_vocabulary_and_template_are_the_worlds(case: dict[str, Any]) -> None:
    """The converter's escaped tokens read back to the world vocabulary's bytes; the file's
    end of turn ("\\n\\n", as llama.cpp chats) ends a generation beside id 0; RWKV's chat
    format stands in for the template name the converter writes."""
    from linserve.model.world_tokenizer import WORLD_CHAT_TEMPLATE, WorldTokenizer

    model = _served(case["gguf"])
    world = WorldTokenizer.from_file(size=model.info.vocab_size)
    tok = model.tokenizer()
    assert tok.token_bytes[1:65530] == world.token_bytes[1:65530]
    assert tok.eos_ids[0] == 0 and world.token_id("\n\n") in tok.eos_ids
    assert model.chat_template() == WORLD_CHAT_TEMPLATE


def test_a_pth_that_is_not_weights_only_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save({"emb.weight": torch.zeros(2, 2), "extra": random.Random(0)}, path)
    with pytest.raises(CheckpointError, match=r"not a weights-only \.pth"):
        loader.load(path)
