"""xLSTM's ``fused`` weight mode (q, k, v and the output gate in one ``qkv_opreact``, the two
gates in ``ifgate_preact``, the feed-forward's gate and up in ``proj_up_gate_z``), which
transformers 5.23 cannot build or load (its initialisation slices the fused gates' bias by
the head count): the ``single`` checkpoint's weights rewritten fused load to the same model,
whose logits are transformers' on the ``single`` one. The rest of xLSTM is tested with every
family (``test_families``, shapes in ``family_fixtures``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from linserve.model import loader
from linserve.model.interface import CheckpointError
from tests.model.family_fixtures import make, reference


def _fused(single: Path, out: Path, layers: int) -> Path:
    out.mkdir()
    sd = load_file(str(single / "model.safetensors"))
    for i in range(layers):
        m, f = f"backbone.blocks.{i}.mlstm_layer.", f"backbone.blocks.{i}.ffn."
        sd[m + "qkv_opreact.weight"] = torch.cat(
            [sd.pop(m + p + ".weight") for p in ("q", "k", "v", "ogate_preact")])
        for leaf in ("weight", "bias"):
            sd[m + "ifgate_preact." + leaf] = torch.cat(
                [sd.pop(m + p + "." + leaf) for p in ("igate_preact", "fgate_preact")])
        sd[f + "proj_up_gate_z.weight"] = torch.cat(
            [sd.pop(f + "proj_up_gate.weight"), sd.pop(f + "proj_up.weight")])
    save_file(sd, str(out / "model.safetensors"))
    cfg = json.loads((single / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "weight_mode": "fused"}))
    (out / "tokenizer.json").write_bytes((single / "tokenizer.json").read_bytes())
    return out


def test_the_fused_weight_mode_is_the_single_ones_model(tmp_path: Path) -> None:
    single = make(tmp_path / "single", "xlstm", "h4-untied")
    fused = _fused(single, tmp_path / "fused", 2)
    ids = torch.randint(0, 8192, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(single)(ids).logits[0]
    a, b = loader.load(single, "float32"), loader.load(fused, "float32")
    got_a, _ = a.module.prefill(ids, all_logits=True)
    got_b, _ = b.module.prefill(ids, all_logits=True)
    assert (got_b[0] - want).abs().max().item() <= 1e-4
    assert torch.equal(got_a, got_b)
    assert b.info.decode_step == a.info.decode_step


def test_heads_that_do_not_split_the_widths_are_one_line(tmp_path: Path) -> None:
    single = make(tmp_path / "single", "xlstm", "h4-untied")
    cfg = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**cfg, "num_heads": 3}))
    with pytest.raises(CheckpointError, match="must split into num_heads 3"):
        loader.load(single, "float32")
