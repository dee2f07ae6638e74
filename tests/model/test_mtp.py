"""Qwen3.5's MTP layer against an independent implementation: the training module of
:mod:`linserve.model.training.qwen_mtp` (transformers' own decoder layer, RoPE and masks),
saved as a checkpoint and read back by the server's loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import loader

transformers = pytest.importorskip("transformers")


def test_mtp_head_equals_the_reference(tmp_path: Path) -> None:
    from linserve.model.training import qwen_mtp
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(qwen_mtp.text_config(8192, 64, 3)).eval()
    mtp = qwen_mtp.MTP(model).eval()
    with torch.no_grad():
        for p in [*model.parameters(), *mtp.parameters()]:
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so each one matters
    qwen_mtp.save(model, mtp, tmp_path, {}, dtype=torch.float32)
    ours = loader.load(tmp_path, "float32")
    head = ours.draft_head()
    assert head is not None
    ids = torch.randint(0, 8192, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state
        want_g = mtp(model, hidden, ids[:, 1:])
        want = model.lm_head(want_g)[0]
    state = head.new_state()
    g = head.extend(state, hidden[0, :7], ids[0, 1:8].tolist())  # 7 positions at once
    g2 = head.extend(state, hidden[0, 7:], ids[0, 8:].tolist())  # then 4 more
    assert torch.allclose(torch.cat([g, g2]), want_g[0], atol=1e-4)
    assert torch.allclose(head.logits(torch.cat([g, g2])), want, atol=1e-3)
    # the served model's own final-norm outputs are transformers' hidden states
    tokens = ids[:, :-1]
    state = ours.new_state(1)
    _, trail = ours.verify(tokens, state)
    assert trail.hidden is not None
    assert torch.allclose(trail.hidden[0], hidden[0], atol=1e-4)


@pytest.mark.parametrize("family,dtype", [("qwen3_5", "float32"), ("qwen3_5", "bfloat16"),
                                          ("qwen3_5_moe", "float32")])
def test_the_native_mtp_call_equals_the_eager_layer(family: str, dtype: str,
                                                    tmp_path: Path) -> None:
    """``decoder_mtp`` (one native call) against the layer in PyTorch: g within fp32
    rounding (bf16: the eager layer rounds its activations to bf16, the native call keeps
    them fp32), several extensions after one another, dense and with experts."""
    from linserve.model import kernels
    from tests.model.family_fixtures import make
    from tests.model.qwen_fixtures import add_mtp, make_checkpoint
    if not kernels.available():
        pytest.skip("no native kernels")
    path = (make_checkpoint(tmp_path, "i4-tied", tokenizer="project") if family == "qwen3_5"
            else make(tmp_path, family, "e8k2-tied"))
    from linserve.model.architectures.qwen3_5 import MtpHead
    from linserve.model.served import ServedModule
    model = loader.load(add_mtp(path), dtype)
    assert isinstance(model, ServedModule)
    head = model.draft_head()
    assert isinstance(head, MtpHead) and head.native_plan() is not None
    g = torch.Generator().manual_seed(2)
    d = model.module.cfg.hidden_size
    native, eager = head.new_state(), head.new_state()
    for n in (5, 1, 3):
        hidden = torch.randn(n, d, generator=g)
        tokens = torch.randint(0, 500, (n,), generator=g).tolist()
        a = head.extend(native, hidden, tokens)
        b = head.extend_eager(eager, hidden, tokens)
        tol = 2e-4 if dtype == "float32" else 5e-2
        assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max()
        assert torch.equal(native.lengths, eager.lengths)
