"""A tied embedding table is held once: as the packed (possibly quantized) LM head, from which
``head_rows`` reads token embeddings (``linserve/model/kernels/embed.h``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linserve.model import kernels, loader, modes, packing, quantize
from linserve.model.served import ServedModule
from tests.model.qwen_fixtures import make_checkpoint

pytestmark = pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")


def _head(table: torch.Tensor, mode: str, packed: bool) -> torch.Tensor:
    """The GEMM head ``[d, V]`` of ``table [V, d]`` as a served model stores it."""
    before = modes.enabled(), modes.quantization()
    modes.set_enabled(packed)
    modes.set_quantization(mode)
    try:
        return packing.pack(table.t())
    finally:
        modes.set_enabled(before[0])
        modes.set_quantization(before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("d", [64, 72, 200])
def test_rows_of_a_dense_head_are_the_table(dtype: torch.dtype, packed: bool, d: int) -> None:
    table = torch.randn(300, d).to(dtype)
    ids = torch.tensor([0, 1, 17, 63, 64, 65, 299, 17])
    rows = torch.ops.linserve.head_rows(_head(table, "none", packed), ids, d)
    assert torch.equal(rows, table[ids].float())


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("d", [64, 96])
def test_rows_of_a_quantized_head_are_its_dequantized_columns(mode: str, d: int) -> None:
    table = torch.randn(257, d)
    ids = torch.tensor([0, 5, 15, 16, 255, 256, 5])
    want = quantize.dequantize(*quantize.quantize(table.t(), mode)).t()[ids]
    rows = torch.ops.linserve.head_rows(_head(table, mode, True), ids, d)
    assert torch.equal(rows, want)


def test_an_out_of_range_token_is_refused() -> None:
    head = _head(torch.randn(10, 32), "none", True)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.linserve.head_rows(head, torch.tensor([10]), 32)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_served_tied_model_holds_its_table_once(tmp_path: Path, quantization: str) -> None:
    path = make_checkpoint(tmp_path / "ck", "i4-tied")
    model = loader.load(path, "float32", quantization=quantization)
    assert isinstance(model, ServedModule)
    emb = model.module.model.embed_tokens
    assert emb.weight.untyped_storage().nbytes() <= 4  # freed: a one-element stub
    head = packing.frozen(emb)
    assert head is not None
    vocab, d = emb.weight.shape
    big = [t for t in [*model.module.parameters(), head] if t.untyped_storage().nbytes()
           >= vocab * d * (1 if quantization == "int8" else 4)]
    assert [t.data_ptr() for t in big] == [head.data_ptr()]  # the head is the only table
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    eager, _ = model.module.prefill(tokens)  # embeddings read from the head
    state = model.new_state(1)
    for t in tokens[0]:
        logits = model.step(t.view(1), state)  # the native step gathers the same rows
    assert torch.allclose(eager, logits, atol=1e-4)
