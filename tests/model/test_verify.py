"""A verify of T tokens per row equals T decode steps bit for bit: its logits at every
position, and the state :func:`keep` lands each row on, for every state kind (Gated DeltaNet
with the native ``decoder_verify``, short convolutions, Mamba2, KV caches, a sliding window's
ring, the own linear and softmax states), in fp32 and bf16, with rows of different lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import loader
from linserve.model.interface import ServedModel
from linserve.model.state import State
from linserve.model.verify import Trail, rollback_tensors
from tests.model.family_fixtures import make
from tests.model.helpers import served, tiny_model
from tests.model.qwen_fixtures import make_checkpoint

pytest.importorskip("transformers")


def _rows(model: ServedModel, seed: int) -> State:
    """Two rows at different lengths (a ragged batch, as the slot pool holds them)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.info.vocab_size
    rows = [model.prefill(torch.randint(0, vocab, (1, n), generator=g))[1] for n in (9, 4)]
    return State.cat(rows)


def _check(model: ServedModel, t: int = 4) -> None:
    state = _rows(model, 0)
    tokens = torch.randint(0, model.info.vocab_size, (2, t),
                           generator=torch.Generator().manual_seed(1))
    stepped, trail_states = state.copy(), []
    want = []
    for i in range(t):
        want.append(model.step(tokens[:, i], stepped))
        trail_states.append(stepped.copy())
    verified = state.copy()
    logits, trail = model.verify(tokens, verified)
    assert torch.equal(logits, torch.stack(want, 1))
    for fed in ((1, t), (t, 2), (3, 1)):
        kept = verified.copy()
        model.keep(kept, _copy(trail), torch.tensor(fed))
        for b, n in enumerate(fed):
            ref = trail_states[n - 1]
            assert int(kept.lengths[b]) == int(ref.lengths[b])
            for x, y in zip(rollback_tensors(kept), rollback_tensors(ref), strict=True):
                assert torch.equal(x[b], y[b])
            for e, f in zip(kept.kv_entries, ref.kv_entries, strict=True):
                n_b = int(ref.lengths[b])
                assert torch.equal(e.k[b, :, :n_b], f.k[b, :, :n_b])
        # and decoding on from the kept state is decoding on from the stepped one
        nxt = torch.tensor([3, 5])
        alone = [trail_states[n - 1].select([b]) for b, n in enumerate(fed)]
        together = model.step(nxt, kept)
        for b in range(2):
            assert torch.equal(together[b], model.step(nxt[b : b + 1], alone[b])[0])


def _copy(trail: Trail) -> Trail:
    return Trail([[x.clone() for x in pos] for pos in trail.positions])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["i4-tied", "i2-untied"])
def test_qwen35_native_verify_is_steps(shape: str, dtype: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from linserve.model.layers import decoder

    def no_fallback(*_: object) -> None:
        raise AssertionError("decoder_verify did not run")

    monkeypatch.setattr(decoder, "verify_by_steps", no_fallback)
    model = loader.load(make_checkpoint(tmp_path, shape, tokenizer="project"), dtype)
    assert model.info.decode_step.startswith("fused")
    _check(model)


@pytest.mark.parametrize("family,shape", [("qwen3_5_moe", "e8k2-tied"),
                                          ("qwen3_next", "e6k2-step2"), ("lfm2", "a2-tied"),
                                          ("granitemoehybrid", "rope-g2"),
                                          ("lfm3", "w16-gate-sandwich")])
def test_families_verify_is_steps(family: str, shape: str, tmp_path: Path) -> None:
    _check(loader.load(make(tmp_path, family, shape), "bfloat16"))


@pytest.mark.parametrize("family,shape", [("lfm2", "a2-tied"), ("lfm2_moe", "e6k2-tied"),
                                          ("granitemoehybrid", "rope-g2"),
                                          ("granitemoehybrid", "moe-e5k2"),
                                          ("nemotron_h", "moe-e6k3-latent"),
                                          ("kimi_linear", "qlora-groups"),
                                          ("kimi_linear", "plain-q"),
                                          ("bailing_hybrid", "safe-g3"),
                                          ("bailing_hybrid", "softplus-g2"),
                                          ("minimax", "b24-factors"),
                                          ("minimax", "b16-tied"),
                                          ("olmo_hybrid", "rope-neg"),
                                          ("olmo_hybrid", "nope-pos")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_native_verify_is_steps(family: str, shape: str, dtype: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """LFM2's short convolutions, Mamba2, attention, experts, KDA and MLA (with and without
    rotary positions, q's low rank and the head gate), lightning attention and MiniMax's
    residual, OLMo-Hybrid's Gated DeltaNet and post-norms in ``decoder_verify``."""
    from linserve.model.layers import decoder

    def no_fallback(*_: object) -> None:
        raise AssertionError("decoder_verify did not run")

    monkeypatch.setattr(decoder, "verify_by_steps", no_fallback)
    model = loader.load(make(tmp_path, family, shape), dtype)
    assert model.info.decode_step.startswith("fused")
    _check(model)


@pytest.mark.parametrize("kind", ["linear", "gated", "softmax", "window", "favor"])
def test_own_models_verify_is_steps(kind: str) -> None:
    extra = {"window": 8} if kind == "window" else {}
    _check(served(tiny_model(kind, max_context=4096, **extra)), t=5)
