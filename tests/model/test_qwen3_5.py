"""What is Qwen3.5's own (linserve/model/architectures/qwen3_5.py): its native prefill scan
and decode steps against the eager forms, the vision-language wrapper, and the gated delta
rule's forms against each other. The tests every family shares (against transformers,
splits, batches, blobs, bf16) run on Qwen3.5 in tests/model/test_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import loader
from linserve.model.layers.ops.delta import delta_rule_chunked, delta_rule_naive, l2norm
from linserve.model.served import ServedModule
from linserve.model.state import State
from tests.model.qwen_fixtures import KERNEL_SHAPES, SHAPES, make_checkpoint, reference

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(SHAPES) + sorted(KERNEL_SHAPES))
def native_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                      ) -> Path:
    """The shapes above and the kernel shapes, for the tests of the native kernels."""
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                           tokenizer="project")


def _served(path: Path) -> ServedModule:
    model = loader.load(path, "float32")
    assert isinstance(model, ServedModule)
    return model


def test_the_native_scan_prefill_equals_the_chunked_form(native_checkpoint: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's two forms of the delta rule: the native recurrent scan (gdn_scan, used
    where the kernels are built) and the chunked WY form in PyTorch (used without them), on a
    150-token prompt after 40 tokens and on a ragged batch: logits and every state tensor
    within fp32 rounding."""
    from linserve.model.layers import gated_delta

    ours = _served(native_checkpoint)
    gen = torch.Generator().manual_seed(11)
    first, rest = (torch.randint(0, 8192, (1, n), generator=gen) for n in (40, 150))
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (5, 90)]

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        _, state = ours.prefill(first)
        logits, state = ours.prefill(rest, state)
        ragged, states = ours.prefill_ragged(prompts, [None, state])
        tensors = [t for st in (state, *states) for e in st.entries()
                   for t in e.tensors().values()]
        return torch.cat([logits, ragged]), tensors

    native = run()
    monkeypatch.setattr(gated_delta.GatedDeltaNet, "native_scan", False)
    chunked = run()
    assert (native[0] - chunked[0]).abs().max().item() <= 1e-4
    for a, b in zip(native[1], chunked[1], strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def test_the_vision_language_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "vl", "i4-tied", vision=True, tokenizer="project")
    ours, ref = _served(path), reference(path)
    tokens = torch.randint(0, 8192, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref(input_ids=tokens).logits[0]
    got, _ = ours.prefill(tokens, all_logits=True)
    assert (got[0] - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("t", [1, 63, 64, 65, 150])
def test_delta_rule_chunked_equals_naive(t: int) -> None:
    """The chunked (WY) form against the token-by-token loop, from a nonzero state."""
    gen = torch.Generator().manual_seed(t)
    b, h, dk, dv = 2, 3, 16, 8
    q, k = (l2norm(torch.randn(b, h, t, dk, generator=gen)) for _ in range(2))
    v = torch.randn(b, h, t, dv, generator=gen)
    g = -torch.rand(b, h, t, generator=gen) * 2
    beta = torch.rand(b, h, t, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    out_c, s_c = delta_rule_chunked(q, k, v, g, beta, s0.clone())
    out_n, s_n = delta_rule_naive(q, k, v, g, beta, s0.clone())
    assert (out_c - out_n).abs().max().item() <= 1e-4
    assert (s_c - s_n).abs().max().item() <= 1e-4


def test_the_fused_gdn_step_equals_the_eager_one(native_checkpoint: Path) -> None:
    """linserve/model/kernels/gdn_step.cpp against the eager step, on a batch of 3 rows with
    different histories, 20 steps: outputs and states within fp32 rounding."""
    from linserve.model import kernels
    from linserve.model.layers.gated_delta import GatedDeltaNet

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    ours = _served(native_checkpoint)
    index = next(i for i, layer in enumerate(ours.module.model.layers)
                 if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet))
    gdn = ours.module.model.layers[index].linear_attn
    gen = torch.Generator().manual_seed(7)
    state = State.cat([ours.prefill(torch.randint(0, 8192, (1, n), generator=gen))[1]
                       for n in (4, 40, 90)])
    fused, eager = state.copy(), state.copy()
    worst = 0.0
    with torch.inference_mode():
        for _ in range(20):
            x = torch.randn(3, 64, generator=gen)
            a = gdn.step_fused(x, fused.layers[index]["recurrent"], fused.layers[index]["conv"])
            b = gdn.step_eager(x, eager.layers[index]["recurrent"], eager.layers[index]["conv"])
            worst = max(worst, (a - b).abs().max().item())
    assert worst <= 1e-5
    for name, t in eager.tensors().items():
        assert (fused.tensors()[name] - t).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_whole_model_step_equals_the_eager_one(native_checkpoint: Path, dtype: str
                                                          ) -> None:
    """The whole-model native step (decoder_step.cpp) against the layer-by-layer step on 3
    rows at different positions, 12 steps. fp32: logits and every state tensor within fp32
    rounding (1e-4).
    bf16: the native step keeps activations fp32 between layers where the eager one rounds
    them to bf16 as transformers does, so the two differ by bf16 rounding. Both are held to
    fp32's next-token distributions: the native step's KL from them no more than 1.5× the
    eager bf16 step's own (or 1e-2, the bound of test_bf16_weights_track_fp32)."""
    from linserve.model import kernels

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    model = loader.load(native_checkpoint, dtype).module
    exact = loader.load(native_checkpoint, "float32").module
    gen = torch.Generator().manual_seed(8)
    state = State.cat([exact.prefill(torch.randint(0, 8192, (1, n), generator=gen))[1]
                       for n in (3, 64, 100)])
    native, eager, ref = state.copy(), state.copy(), state.copy()
    worst, kl = 0.0, [0.0, 0.0]
    for _ in range(12):
        tokens = torch.randint(0, 8192, (3,), generator=gen)
        a, b = model.step(tokens, native), model.step_eager(tokens, eager)
        want = torch.log_softmax(exact.step_eager(tokens, ref), -1)
        worst = max(worst, (a - b).abs().max().item())
        for i, got in enumerate((a, b)):
            got = torch.log_softmax(got, -1)
            kl[i] = max(kl[i], (want.exp() * (want - got)).sum(-1).max().item())
    if dtype == "float32":
        assert worst <= 1e-4
        for name, t in eager.tensors().items():
            assert (native.tensors()[name] - t).abs().max().item() <= 1e-4, name
    else:
        assert kl[0] <= max(1e-2, 1.5 * kl[1]), kl
    assert torch.equal(native.lengths, eager.lengths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_native_step_does_not_depend_on_the_batch(native_checkpoint: Path, dtype: str
                                                         ) -> None:
    """Batch invariance of the native step: each row's logits and state are the same bits
    alone as beside four other rows at other positions."""
    from linserve.model import kernels

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    model = loader.load(native_checkpoint, dtype).module
    gen = torch.Generator().manual_seed(9)
    rows = [model.prefill(torch.randint(0, 8192, (1, n), generator=gen))[1]
            for n in (2, 30, 64, 65, 129)]
    batch = State.cat([r.copy() for r in rows])
    tokens = torch.randint(0, 8192, (5,), generator=gen)
    together = model.step(tokens, batch)
    for i, row in enumerate(rows):
        alone = model.step(tokens[i : i + 1], row)
        assert torch.equal(alone[0], together[i])




def test_a_checkpoint_is_checked_once_as_its_files_are(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's check and the load's own check run the family's check once for the
    same files; a changed file checks again, and a check that fails raises every time."""
    from linserve.model.architectures import hf

    path = make_checkpoint(tmp_path / "ck", sorted(SHAPES)[0], tokenizer="project")
    runs: list[Path] = []
    real = hf.plan
    monkeypatch.setattr(hf, "plan", lambda *a, **k: (runs.append(a[1]), real(*a, **k))[1])
    loader.check(path, "float32")
    loader.load(path, "float32", weights=False)
    assert runs == [path]
    (path / "config.json").write_text((path / "config.json").read_text() + " ")
    loader.check(path, "float32")
    assert runs == [path, path]
    (path / "tokenizer.json").write_text("{")
    for _ in range(2):
        with pytest.raises(loader.CheckpointError, match=r"tokenizer\.json"):
            loader.check(path, "float32")
