"""RWKV-6 and RWKV-4 against their references. RWKV-6: BlinkDL's (the ``rwkv`` package on a
``.pth``, fp32), with one set of random weights written as the ``.pth``, as the Hugging Face
folder and as the GGUF file llama.cpp's converter makes of that folder (which divides the
output projections every ``rescale_every`` layers, as llama.cpp's graph halves the residual),
so one reference checks all three loaders. RWKV-4: transformers' ``RwkvForCausalLM`` (eval
mode, rescaling every two layers) on its own random checkpoint, and BlinkDL's reference on a
``.pth``. Logits within 1e-4, greedy continuations identical, the state as the reference's,
prompt splits and steps equal, a row in a batch bit-equal to itself alone, bf16 within KL 1e-2,
state files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from linserve.model import kernels, loader, state_files
from linserve.model.interface import CheckpointError
from linserve.model.served import ServedModule
from linserve.model.state import State
from tests.model import rwkv_fixtures
from tests.model.gguf_fixtures import convert

PROMPT = [1, 2, 3, 400, 3000, 17, 17, 255, 256, 1024, 98, 7]


def _served(path: Path, dtype: str = "float32") -> ServedModule:
    model = loader.load(path, dtype)
    assert isinstance(model, ServedModule)
    return model


def _greedy(model: ServedModule, prompt: list[int], n: int = 6) -> list[int]:
    logits, state = model.module.prefill(torch.tensor([prompt]))
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = model.module.step(torch.tensor(out[-1:]), state)
    return out


@pytest.fixture(scope="module", params=sorted(rwkv_fixtures.SHAPES6))
def case6(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Any]:
    """A shape's ``.pth``, its folder, its GGUF (rescaled every 2 layers), the reference."""
    shape = request.param
    tmp = tmp_path_factory.mktemp(shape)
    pth = rwkv_fixtures.write_pth_of(tmp / "pth", rwkv_fixtures.blinkdl_weights6(shape))
    hf = rwkv_fixtures.write_hf_rwkv(tmp / "hf", pth)
    rescaled = rwkv_fixtures.write_hf_rwkv(tmp / "hf-rescaled", pth, rescale_every=2)
    gguf = convert(rescaled, tmp / "model.gguf", "f32", pre=None)
    greedy = _greedy(_served(pth), PROMPT)
    ref = rwkv_fixtures.reference(pth, PROMPT, greedy, tmp)
    return {"pth": pth, "hf": hf, "hf-rescaled": rescaled, "gguf": gguf, "greedy": greedy,
            "ref": ref, "tmp": tmp, "shape": shape}


def _check_logits(model: ServedModule, ref: torch.Tensor, greedy: list[int]) -> State:
    n = len(PROMPT)
    logits, state = model.module.prefill(torch.tensor([PROMPT]), all_logits=True)
    assert (logits[0] - ref[:n]).abs().max().item() <= 1e-4
    for i, token in enumerate(greedy):
        step = model.module.step(torch.tensor([token]), state)
        assert (step[0] - ref[n + i]).abs().max().item() <= 1e-4
    return state


@pytest.mark.parametrize("layout", ["pth", "hf", "hf-rescaled", "gguf"])
def test_rwkv6_logits_and_state_are_the_references(case6: dict[str, Any], layout: str
                                                   ) -> None:
    model = _served(case6[layout])
    assert model.info.architecture.startswith("rwkv6")
    ref = case6["ref"]
    state = _check_logits(model, ref["logits"], case6["greedy"])
    for i, entries in enumerate(state.layers):  # [att shift, S (key × value), ffn shift]
        want = ref["state"][3 * i : 3 * i + 3]
        ours = [entries["conv"].window[0, 0], entries["recurrent"].s[0].transpose(1, 2),
                entries["ffn"].window[0, 0]]
        for a, b in zip(ours, want, strict=True):  # (rescaled: the norms' eps moves)
            assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


def test_rwkv6_greedy_is_the_references(case6: dict[str, Any]) -> None:
    ref = case6["ref"]["logits"]
    n = len(PROMPT)
    picks = [int(ref[n - 1 + i].argmax()) for i in range(len(case6["greedy"]))]
    assert picks == case6["greedy"]


def _splits_steps_and_batch(model: ServedModule) -> None:
    """Whole, two chunks, token by token: the same logits; the native step (the whole model in
    one call) as the eager one; a verify of three tokens as three steps; a row beside others
    bit-equal to itself alone."""
    module = model.module
    if kernels.load():
        assert model.info.decode_step.startswith("fused") and module.native_plan() is not None
    whole, state = module.prefill(torch.tensor([PROMPT]))
    _, half = module.prefill(torch.tensor([PROMPT[:5]]))
    split, _ = module.prefill(torch.tensor([PROMPT[5:]]), half)
    steps = module.new_state(1)
    for token in PROMPT:
        by_steps = module.step(torch.tensor([token]), steps)
    for other in (split, by_steps):
        assert (other - whole).abs().max().item() <= 1e-5 * max(1.0, whole.abs().max().item())
    eager = state.copy()
    for token in (5, 6, 7):
        a = module.step(torch.tensor([token]), state)
        b = module.step_eager(torch.tensor([token]), eager)
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    stepped = state.copy()
    logits, _ = module.verify(torch.tensor([[11, 12, 13]]), state)
    for i, token in enumerate((11, 12, 13)):
        one = module.step(torch.tensor([token]), stepped)
        assert (logits[0, i] - one[0]).abs().max().item() <= 1e-5 * max(1.0, one.abs().max())
    rows = [module.prefill(torch.tensor([PROMPT[:n]]))[1] for n in (3, 7, 12)]
    together = module.step(torch.tensor([9, 9, 9]), State.cat([r.copy() for r in rows]))
    for i, row in enumerate(rows):
        assert torch.equal(module.step(torch.tensor([9]), row)[0], together[i])
    ragged, _ = module.prefill_ragged([PROMPT[:4], PROMPT], [None, None])
    for i, n in enumerate((4, len(PROMPT))):
        alone, _ = module.prefill(torch.tensor([PROMPT[:n]]))
        assert (ragged[i] - alone[0]).abs().max().item() <= 1e-5 * max(
            1.0, alone.abs().max().item())


def _blobs_and_int8(model: ServedModule, path: Path) -> None:
    """A state blob round-trips and continues the same bits; int8 weights serve, their
    greedy first token the fp32 one's."""
    _, state = model.prefill(torch.tensor([PROMPT]))
    back, _ = model.state_from_bytes(model.state_to_bytes(state))
    for token in (5, 6, 7):
        assert torch.equal(model.step(torch.tensor([token]), state),
                           model.step(torch.tensor([token]), back))
    int8 = loader.load(path, "float32", quantization="int8")
    exact = model.prefill(torch.tensor([PROMPT]))[0]
    assert int(int8.prefill(torch.tensor([PROMPT]))[0].argmax()) == int(exact.argmax())


def test_rwkv6_splits_steps_and_batch(case6: dict[str, Any]) -> None:
    _splits_steps_and_batch(_served(case6["gguf"]))
    _blobs_and_int8(_served(case6["hf"]), case6["hf"])


def test_rwkv6_bf16_tracks_fp32(case6: dict[str, Any]) -> None:
    _bf16_tracks(case6["hf"])


def _bf16_tracks(path: Path) -> None:
    exact = _served(path).module.prefill(torch.tensor([PROMPT]), all_logits=True)[0]
    half = _served(path, "bfloat16").module.prefill(torch.tensor([PROMPT]), all_logits=True)[0]
    p = torch.log_softmax(exact[0], -1)
    q = torch.log_softmax(half[0].float(), -1)
    assert (p.exp() * (p - q)).sum(-1).max().item() <= 1e-2


def test_rwkv6_state_file_continues_as_the_reference(case6: dict[str, Any]) -> None:
    """A state-tuned file (v6's, value × key as RWKV-Runner reads it) as the initial state:
    the reference from that state gives the same logits; written back, it is the file."""
    tmp = case6["tmp"]
    s = rwkv_fixtures.SHAPES6[case6["shape"]]
    gen = torch.Generator().manual_seed(3)
    file = tmp / "tuned.pth"
    torch.save({f"blocks.{i}.att.time_state":
                torch.randn(s["d"] // s["head"], s["head"], s["head"], generator=gen) * 0.5
                for i in range(s["layers"])}, file)
    model = _served(case6["pth"])
    state = state_files.read(model.module, file.read_bytes(), model.module.new_state(1))
    logits, _ = model.module.prefill(torch.tensor([PROMPT]), state, all_logits=True)
    ref = rwkv_fixtures.reference(case6["pth"], PROMPT, [], tmp, state_file=file)
    assert (logits[0] - ref["logits"]).abs().max().item() <= 1e-4
    back = torch.load(io.BytesIO(state_files.write(model.module, state)), weights_only=True)
    want = torch.load(file, weights_only=True)
    assert all(torch.equal(back[k], want[k]) for k in want)


# RWKV-4


@pytest.fixture(scope="module")
def case4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("rwkv4")
    pth = rwkv_fixtures.write_pth_of(tmp / "pth", rwkv_fixtures.blinkdl_weights4())
    greedy = _greedy(_served(pth), PROMPT)
    return {"pth": pth, "greedy": greedy, "ref": rwkv_fixtures.reference(pth, PROMPT, greedy,
                                                                         tmp)}


def test_rwkv4_pth_is_the_references(case4: dict[str, Any]) -> None:
    model = _served(case4["pth"])
    assert model.info.architecture.startswith("rwkv4")
    state = _check_logits(model, case4["ref"]["logits"], case4["greedy"])
    ref = case4["ref"]["state"]
    for i, entries in enumerate(state.layers):  # [att shift, num, den, p, ffn shift]
        num, den, _ = entries["recurrent"].s[0, :, 0]
        assert (entries["conv"].window[0, 0] - ref[5 * i]).abs().max().item() <= 1e-4
        assert (entries["ffn"].window[0, 0] - ref[5 * i + 4]).abs().max().item() <= 1e-4
        # num / den is the state's meaning whatever exponent each side keeps it at
        assert torch.allclose(num / den, ref[5 * i + 1] / ref[5 * i + 2], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=[(64, 4, 2), (96, 3, 0)], ids=["d64-l4-r2", "d96-l3"])
def hf4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> dict[str, Any]:
    """transformers' RWKV-4 of a shape (hidden, layers, rescale_every), random, saved."""
    from transformers import RwkvConfig, RwkvForCausalLM

    d, layers, rescale = request.param
    torch.manual_seed(0)
    cfg = RwkvConfig(vocab_size=4096, context_length=256, hidden_size=d,
                     num_hidden_layers=layers, attention_hidden_size=d,
                     intermediate_size=3 * d, rescale_every=rescale, tie_word_embeddings=False)
    ref = RwkvForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers' init leaves the projections near zero
        for name, p in ref.named_parameters():
            if name.endswith(("key.weight", "value.weight", "receptance.weight",
                              "output.weight")):
                p.normal_(0, p.shape[1] ** -0.5 * 2)
    folder = tmp_path_factory.mktemp("hf4")
    ref.save_pretrained(folder)
    _tokenizer(folder, 4096)
    return {"path": folder, "ref": ref}


def _tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json of ``vocab`` ids (the ids are what the test feeds)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.save(str(folder / "tokenizer.json"))


def test_rwkv4_is_transformers(hf4: dict[str, Any]) -> None:
    model = _served(hf4["path"])
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf4["ref"](ids, use_cache=True)
        want, cache = out.logits[0], out.state
        ours, state = model.module.prefill(ids, all_logits=True)
        assert (ours[0] - want).abs().max().item() <= 1e-4
        ours = ours[:, -1]
        for _ in range(5):
            nxt = int(ours[0].argmax())
            assert nxt == int(want[-1].argmax())
            out = hf4["ref"](torch.tensor([[nxt]]), state=cache, use_cache=True)
            want, cache = out.logits[0], out.state
            ours = model.module.step(torch.tensor([nxt]), state)
            assert (ours[0] - want[-1]).abs().max().item() <= 1e-4


def test_rwkv4_splits_steps_batch_and_bf16(hf4: dict[str, Any]) -> None:
    _splits_steps_and_batch(_served(hf4["path"]))
    _blobs_and_int8(_served(hf4["path"]), hf4["path"])
    _bf16_tracks(hf4["path"])


def test_an_rwkv5_pth_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save({"emb.weight": torch.zeros(2, 2), "blocks.0.att.ln_x.weight": torch.zeros(2)},
               path)
    with pytest.raises(CheckpointError, match=r"a \.pth of RWKV-5"):
        loader.load(path)


def test_a_pth_of_another_vocabulary_needs_its_tokenizer(tmp_path: Path) -> None:
    """An RWKV-4 "pile" ``.pth`` (a vocabulary smaller than the world's) is refused without
    its tokenizer.json, and served with the one beside it."""
    pth = rwkv_fixtures.write_pth_of(tmp_path, rwkv_fixtures.blinkdl_weights4(vocab=4096))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json beside it"):
        loader.load(pth)
    _tokenizer(tmp_path, 4096)
    assert loader.load(pth, "float32").tokenizer().vocab_size == 4096


def test_a_pth_with_its_tuned_state_merged_starts_from_it(case6: dict[str, Any]) -> None:
    """A ``.pth`` holding ``blocks.N.att.time_state`` beside its weights (a state-tuned model
    merged): every sequence starts from that state, as BlinkDL's reference starts it."""
    s = rwkv_fixtures.SHAPES6[case6["shape"]]
    gen = torch.Generator().manual_seed(5)
    weights = rwkv_fixtures.blinkdl_weights6(case6["shape"])
    for i in range(s["layers"]):
        weights[f"blocks.{i}.att.time_state"] = torch.randn(
            s["d"] // s["head"], s["head"], s["head"], generator=gen) * 2
    tmp = case6["tmp"] / "merged"
    pth = rwkv_fixtures.write_pth_of(tmp, weights)
    logits, _ = _served(pth).prefill(torch.tensor([PROMPT]), all_logits=True)
    ref = rwkv_fixtures.reference(pth, PROMPT, [], tmp)["logits"]
    assert (logits[0] - ref).abs().max().item() <= 1e-4
    plain = rwkv_fixtures.reference(case6["pth"], PROMPT, [], tmp)["logits"]
    assert (plain - ref).abs().max().item() > 1e-2  # the state matters
