"""What the family-wide checks (test_families.py) do not see of Zamba2's shared blocks and
RecurrentGemma's RG-LRU and local attention: shared weights held once, a session's state
constant in size past the window, and the RG-LRU's batch-invariant gates equal to the
plain product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import loader, modes
from linserve.model.layers.rg_lru import RGLRU
from linserve.model.layers.shared_block import MambaLayer
from linserve.model.served import ServedModule
from tests.model.family_fixtures import make, reference

pytest.importorskip("transformers")


def _served(path: Path) -> ServedModule:
    model = loader.load(path, "float32")
    assert isinstance(model, ServedModule)
    return model


def test_zamba2_holds_each_shared_block_once(tmp_path: Path) -> None:
    """Three hybrid layers over two shared blocks (tied, as transformers ties them): layers
    1 and 4 use one block object; the parameters are transformers' unique ones."""
    path = make(tmp_path / "z", "zamba2", "two-blocks-adapters")
    module = _served(path).module
    assert len(module.model.shared_blocks) == 2
    layers = [m for m in module.model.layers if isinstance(m, MambaLayer)]
    hybrid = [m for m in layers if m.block is not None]
    assert [m.block for m in hybrid] == [0, 1, 0]
    assert hybrid[0].shared[0] is hybrid[2].shared[0] is module.model.shared_blocks[0]
    ref = reference(path)
    unique = {p.data_ptr(): p.numel() for p in ref.parameters()}
    assert len(unique) < len(list(ref.named_parameters(remove_duplicate=False)))
    assert module.n_params() == sum(unique.values())


def test_recurrent_gemma_state_stays_constant_past_the_window(tmp_path: Path) -> None:
    """The local attention's keys are a ring of W slots: a session's state has the same size
    after W, 3·W and 10·W tokens, and nothing in it grows with the context."""
    path = make(tmp_path / "rg", "recurrent_gemma", "w16-gqa")
    served = _served(path)
    sizes = []
    state = None
    for _ in range(3):
        _, state = served.module.prefill(torch.randint(0, 8192, (1, 16 * 3)), state)
        sizes.append(state.nbytes)
    assert int(state.lengths[0]) == 144 and len(set(sizes)) == 1
    assert not state.truncatable  # a ring has overwritten what it would forget
    windows = [e.capacity for e in state.kv_entries]
    assert windows and all(c == 16 for c in windows)


def test_rg_lru_gates_are_the_same_product_with_the_mode_on() -> None:
    """The per-head batch-invariant products equal the plain block-diagonal one."""
    torch.manual_seed(0)
    lru = RGLRU(48, 6)
    with torch.no_grad():
        for p in lru.parameters():
            p.normal_()
    u = torch.randn(3, 5, 48)
    was = modes.enabled()
    try:
        modes.set_enabled(False)
        plain = lru._gates(u)
        modes.set_enabled(True)
        fixed = lru._gates(u)
    finally:
        modes.set_enabled(was)
    for a, b in zip(plain, fixed, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_the_native_kda_scan_equals_its_pytorch_recurrence() -> None:
    """``kda_scan_`` against :meth:`KimiDeltaAttention.scan_eager`: outputs and states within
    fp32 rounding, a ragged batch's padding left alone."""
    from linserve.model import kernels
    from linserve.model.layers.kimi_delta import KdaShape, KimiDeltaAttention

    if not kernels.available():
        pytest.skip("the native kernels are not built")
    torch.manual_seed(0)
    layer = KimiDeltaAttention(KdaShape(32, 3, 16, 4, 1e-6))
    b, t, h, d = 3, 9, 3, 16
    q, k = (torch.nn.functional.normalize(torch.randn(b, t, h, d), dim=-1) for _ in range(2))
    v = torch.randn(b, t, h, d)
    decay, beta = torch.rand(b, t, h, d) * 0.5 + 0.5, torch.rand(b, t, h)
    new = torch.tensor([9, 4, 7])
    s0 = torch.randn(b, h, d, d)
    want_s = s0.clone()
    want = layer.scan_eager(want_s, q, k, v, decay, beta, new)
    got_s, got = s0.clone(), torch.empty_like(v)
    torch.ops.linserve.kda_scan_(got_s, got, q, k, v, decay, beta, new)
    assert (got - want).abs().max().item() <= 1e-4
    assert (got_s - want_s).abs().max().item() <= 1e-4


def test_mla_caches_the_latent_once(tmp_path: Path) -> None:
    """Kimi-Linear's latent attention keeps kv_lora_rank + qk_rope_head_dim floats a token
    and layer (its keys; no values), and a session's per-token bytes say so."""
    from linserve.model.architectures import kimi_linear
    from linserve.model.architectures.family import state_sizes

    path = make(tmp_path / "k", "kimi_linear", "qlora-groups")
    served = _served(path)
    _, state = served.module.prefill(torch.randint(0, 8192, (1, 20)))
    caches = state.kv_entries
    assert len(caches) == 1  # one MLA layer in the shape
    assert caches[0].k.shape[-1] == 32 + 8 and caches[0].v.shape[-1] == 0
    cfg = kimi_linear.FAMILY.read_config(path)
    assert state_sizes(served.module, cfg.max_position_embeddings)[1] == (32 + 8) * 4
