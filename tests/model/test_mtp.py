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
