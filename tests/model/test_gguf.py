"""GGUF files (:mod:`linserve.model.gguf`): the vocabulary against llama.cpp's own test vectors,
every served block format against gguf-py's dequantizer, and files written by llama.cpp's
converter from tiny random checkpoints giving the same logits as the safetensors they came
from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from bench import llamacpp_assets
from linserve.model import loader, packing, quantize
from linserve.model.gguf import vocab
from linserve.model.gguf.checkpoint import NATIVE, SERVED, dequantize
from linserve.model.gguf.files import Tensor, open_model
from linserve.model.interface import CheckpointError, ServedModel
from tests.model import family_fixtures, gguf_fixtures
from tests.model.qwen_fixtures import make_checkpoint

BPE = ["qwen35", "qwen2", "gpt-2", "llama-bpe", "command-r", "deepseek-coder", "deepseek-llm",
       "falcon", "mpt", "refact", "starcoder"]
SPM = ["llama-spm", "phi-3"]


@pytest.mark.parametrize("name", BPE + SPM)
def test_the_vocabulary_encodes_llamacpps_test_vectors(name: str) -> None:
    """Each ``ggml-vocab-*.gguf`` of llama.cpp with ``.inp`` / ``.out`` vectors, byte-level
    BPE with its pre-tokenizer and SentencePiece BPE, encodes every text to llama.cpp's ids,
    and decodes back to the text."""
    path = llamacpp_assets.vendored(f"models/ggml-vocab-{name}.gguf")
    tok = vocab.build(open_model(path).meta)
    inp = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    out = [[int(x) for x in line.split()] for line in Path(f"{path}.out").read_text()
           .split("\n")]
    assert len(inp) > 40
    for text, want in zip(inp, out, strict=False):
        assert tok.encode(text, add_special_tokens=False).ids == want, text


def test_a_large_vocabulary_is_built_once_and_read_back(tmp_path: Path) -> None:
    """Qwen3.5's 248k-token vocabulary: built at the first load and kept under the cache
    root; the next load reads it back and encodes llama.cpp's test vectors to the same ids;
    a replaced file (another modification time) is built again."""
    import os
    import shutil

    from linserve.model.gguf import vocab_cache
    path = tmp_path / "ggml-vocab-qwen35.gguf"
    shutil.copy(llamacpp_assets.vendored("models/ggml-vocab-qwen35.gguf"), path)
    model, root = open_model(path), tmp_path / "cache"
    built = vocab_cache.load(model.files, model.meta, root)
    entry = vocab_cache.cache_file(model.files, root)
    assert entry.is_file() and list(root.iterdir()) == [entry]
    again = vocab_cache.load(model.files, model.meta, root)
    texts = Path(f"{llamacpp_assets.vendored('models/ggml-vocab-qwen35.gguf')}.inp") \
        .read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    for text in texts:
        assert again.encode(text, add_special_tokens=False).ids == \
            built.encode(text, add_special_tokens=False).ids
    assert again.to_str() == built.to_str()
    os.utime(path, ns=(1, 1))
    assert vocab_cache.cache_file(open_model(path).files, root) != entry


def test_only_the_vocabularies_used_last_are_kept(tmp_path: Path) -> None:
    """The cache keeps the KEEP entries used last: older ones go with their byte tables, and
    an entry read back counts as used."""
    import os

    from linserve.model.gguf import vocab_cache
    root = tmp_path / "cache"
    root.mkdir()
    for i in range(vocab_cache.KEEP + 3):
        for suffix in (".json", ".bytes"):
            (root / f"{i:02d}{suffix}").write_text("{}")
            os.utime(root / f"{i:02d}{suffix}", ns=(i * 10**9, i * 10**9))
    os.utime(root / "01.json")  # read just now
    vocab_cache.prune(root)
    kept = sorted(p.name for p in root.iterdir())
    assert len(kept) == 2 * vocab_cache.KEEP
    assert "01.json" in kept and "01.bytes" in kept
    assert not {"00.json", "00.bytes", "02.json", "02.bytes", "03.json"} & set(kept)


def test_the_byte_table_is_kept_beside_the_vocabulary(tmp_path: Path) -> None:
    """The tokenizer's byte table of a large vocabulary is kept beside it and read back equal
    to the one made from the tokenizer; a cut-short entry is passed over (made again)."""
    import shutil

    from linserve.model.gguf import vocab_cache
    from linserve.model.tokenizer import byte_table
    path = tmp_path / "ggml-vocab-qwen35.gguf"
    shutil.copy(llamacpp_assets.vendored("models/ggml-vocab-qwen35.gguf"), path)
    model, root = open_model(path), tmp_path / "cache"
    assert vocab_cache.load_bytes(model.files, model.meta, root) is None
    table = byte_table(vocab_cache.load(model.files, model.meta, root))
    vocab_cache.keep_bytes(model.files, model.meta, table, root)
    assert vocab_cache.load_bytes(model.files, model.meta, root) == table
    entry = vocab_cache.cache_file(model.files, root).with_suffix(".bytes")
    entry.write_bytes(entry.read_bytes()[:-1])
    assert vocab_cache.load_bytes(model.files, model.meta, root) is None


def test_a_kept_vocabulary_is_read_when_first_needed(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a large vocabulary and its byte table are kept, a checkpoint's tokenizer decodes
    and knows its end ids without reading the vocabulary (reading it holds the GIL for half
    a second); its first encode reads it, and encodes as the vocabulary built afresh."""
    from linserve.model.gguf import checkpoint as ck
    from linserve.model.gguf import vocab_cache
    monkeypatch.setattr(vocab_cache, "cache_root", lambda: tmp_path / "cache")
    hf = make_checkpoint(tmp_path / "qwen", "i4-tied")
    path = gguf_fixtures.convert(hf, tmp_path / "qwen.gguf", pre=None, extra=NO_MTP)
    size = len(open_model(path).meta["tokenizer.ggml.tokens"])
    assert size >= vocab_cache.SMALLEST
    first = ck.GGUFCheckpoint(path).tokenizer(size)  # builds and keeps both
    text = "Hello world, <|im_start|>user\nwhat's 2+2?<|im_end|>"
    ids = first.encode(text)
    again = ck.GGUFCheckpoint(path)
    tok = again.tokenizer(size)
    assert again._vocab_read is None
    assert tok.decode(ids) == first.decode(ids) and tok.eos_ids == first.eos_ids
    assert again._vocab_read is None
    assert tok.encode(text) == ids and again._vocab_read is not None


def test_a_files_string_arrays_read_as_gguf_py_reads_them() -> None:
    """A vocabulary's tokens and merges (read when asked for, :class:`files.Strings`) are
    the strings gguf-py's reader gives, whole, one by one, by slices and counted."""
    import gguf

    from linserve.model.gguf import files
    path = llamacpp_assets.vendored("models/ggml-vocab-qwen35.gguf")
    meta, reader = open_model(path).meta, gguf.GGUFReader(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        field = reader.fields[key]
        want = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        got = meta[key]
        assert isinstance(got, files.Strings) and len(got) == len(want)
        assert list(got) == want and got[-1] == want[-1] and got[7:19] == want[7:19]
        assert [got[i] for i in range(0, len(want), 997)] == want[::997]


def test_sentencepiece_puts_bos_first_where_the_file_says() -> None:
    meta = open_model(llamacpp_assets.vendored("models/ggml-vocab-llama-spm.gguf")).meta
    tok = vocab.build(meta)
    assert tok.encode("Hello world").ids[0] == meta["tokenizer.ggml.bos_token_id"]
    assert tok.decode(tok.encode("Hello world").ids, skip_special_tokens=True) == "Hello world"


@pytest.mark.parametrize("qtype", [q for q in SERVED if q not in (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)],
    ids=lambda q: q.name)
def test_every_block_format_dequantizes_as_gguf_py_does(qtype: GGMLQuantizationType) -> None:
    raw = gguf_fixtures.random_blocks(qtype, 6, 512)
    t = Tensor("w", (6, 512), qtype, raw, raw.nbytes)
    want = quants.dequantize(raw, qtype).reshape(6, 512)
    got = dequantize(t).numpy()
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_q6_k_values_natively_as_pytorch_unpacks_them() -> None:
    """The native Q6_K unpack (``q6_k_values``, used where the kernels load) gives the values
    of the PyTorch form the loader falls back to, on random blocks."""
    from linserve.model import kernels
    from linserve.model.gguf import checkpoint

    if not kernels.load():
        pytest.skip("no native kernels")
    b = gguf_fixtures.random_blocks(GGMLQuantizationType.Q6_K, 40, 1024).reshape(-1, 210)
    slow = (checkpoint._nibbles(b[:, :128], 128)
            | (checkpoint._bits(b[:, 128:192], 2, 4) << 4)).view(torch.int8) - 32
    assert torch.equal(torch.ops.linserve.q6_k_values(torch.from_numpy(b.copy())), slow)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                                   GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_0,
                                   GGMLQuantizationType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 7, 16, 150])
def test_blocks_pack_straight_from_the_file_as_from_their_values(
        qtype: GGMLQuantizationType, rows: int) -> None:
    """``pack_gguf`` (a GGUF matrix's rows of blocks straight into the GEMM's stored format,
    what a load uses) writes the very bytes ``pack_quantized`` writes from their values and
    scales (``block_values``, the form tested against gguf-py), for widths of whole and
    partial panels on AVX2 and AVX-512 builds alike."""
    from linserve.model import kernels
    from linserve.model.gguf.checkpoint import NATIVE, PACKED_RAW, block_values

    if not kernels.load():
        pytest.skip("no native kernels")
    assert qtype in PACKED_RAW
    k = 768  # three super-blocks a row
    raw = gguf_fixtures.random_blocks(qtype, rows, k, seed=rows)
    q, scales = block_values(Tensor("w", (rows, k), qtype, raw, raw.nbytes))
    scales = scales.permute(2, 1, 0) if scales.dim() == 3 else scales.t()
    want = torch.ops.linserve.pack_quantized(q.t(), scales, NATIVE[qtype])
    got = torch.ops.linserve.pack_gguf(torch.from_numpy(raw.copy()), int(qtype))
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_q8_0_matrix_holding_minus_128_is_told_apart() -> None:
    """A Q8_0 matrix with a value of −128 is dequantized instead of packed (the AVX2
    product takes each value's sign apart); the check reads the values, not the scales."""
    from linserve.model.gguf import checkpoint

    raw = gguf_fixtures.random_blocks(GGMLQuantizationType.Q8_0, 6, 256, seed=2)
    raw = raw.reshape(6, -1, 34)
    raw[..., 2:][raw[..., 2:] == 0x80] = 0x81
    raw[..., :2] = 0x80  # scales' bytes may be anything
    t = Tensor("w", (6, 256), GGMLQuantizationType.Q8_0, raw.reshape(6, -1), raw.nbytes)
    assert not checkpoint._holds_minus_128(t)
    raw[4, 5, 33] = 0x80
    assert checkpoint._holds_minus_128(t)


# (family, shape, converter arguments): every served family llama.cpp's converter writes,
# in shapes it can represent (it writes no RoPE for a Granite-4.0-H hybrid, and Qwen3-Next
# only with all-MoE layers)
NO_MTP = ("--no-mtp",)  # Qwen checkpoints without MTP layers: the converter expects them
CONVERTED = [("qwen3_5", "i2-untied", NO_MTP), ("qwen3_5", "i3-gqa", NO_MTP),
             ("qwen3_5_moe", "e8k2-tied", NO_MTP), ("qwen3_5_moe", "e5k3-untied", NO_MTP),
             ("qwen3_next", "e9k3-nonorm", NO_MTP),
             ("lfm2", "a1-untied", ()), ("lfm2", "a2-tied", ()),
             ("lfm2_moe", "e6k2-tied", ()),  # the converter has no untied LFM2-MoE head
             ("granitemoehybrid", "nope-g1", ()), ("granitemoehybrid", "moe-e8k3", ()),
             ("bamba", "full-rope-g1", ()), ("bamba", "half-rope-g2", ()),
             ("nemotron_h", "a-g2", ()), ("nemotron_h", "moe-e8k2-g4", ()),
             ("jamba", "dense-tied", ()), ("jamba", "moe-e4k2", ()),
             ("falcon_h1", "norm-g2", ()), ("falcon_h1", "gate-g1", ()),
             ("mamba", "tied-r4", ()), ("mamba", "falcon-untied", ()),
             ("mamba2", "g1-tied", ()), ("mamba2", "g2-untied", ()),
             # the converter writes no expert groups for Kimi-Linear (the published model
             # has one), so the shape without them
             ("kimi_linear", "plain-q", ()),
             # Ling 3.0 (bailingmoe3): gguf-py on PyPI has no map of its names; the
             # converter takes only the safe KDA gate and writes no expert groups
             ("bailing_hybrid", "safe-g2-one-group", ())]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(safetensors folder, its F32 GGUF) for each of :data:`CONVERTED`."""
    root = tmp_path_factory.mktemp("gguf")
    made = {f"{family}-{shape}": (family_fixtures.make(root / f"{family}-{shape}", family, shape),
                                  extra) for family, shape, extra in CONVERTED}
    files = gguf_fixtures.convert_many([gguf_fixtures.Conversion(hf, root / f"{case}.gguf",
                                                                 extra=extra)
                                        for case, (hf, extra) in made.items()])
    return {case: (hf, file) for (case, (hf, _)), file in zip(made.items(), files, strict=True)}


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits, the KV caches fp32 whether or not the file is quantized."""
    model = loader.load(path, dtype="float32", kv_cache_dtype="fp32")
    return model.prefill(ids, all_logits=True)[0]


def _near_the_dequantized(native: ServedModel, file: Path, flat: Path, ids: torch.Tensor,
                          floor: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The natively served model's logits for ``ids`` (1, T, V), checked against the
    dequantized file's: within ``floor`` of their largest, or 1.5x the file's bf16 copy's
    distance (the int8 activations' rounding; a broken kernel moves them by their own size).
    Returns the served logits, the dequantized file's, and the bound."""
    want = _logits(flat, ids)
    got = native.prefill(ids, all_logits=True)[0]
    in_bf16 = loader.load(file, dtype="bfloat16").prefill(ids, all_logits=True)[0]
    bound = max(floor * want.abs().max().item(), 1.5 * (in_bf16 - want).abs().max().item())
    assert (got - want).abs().max().item() < bound
    return got, want, bound


@pytest.mark.parametrize("case", [f"{f}-{s}" for f, s, _ in CONVERTED])
def test_a_converted_file_gives_the_checkpoints_logits(
        converted: dict[str, tuple[Path, Path]], case: str) -> None:
    hf, file = converted[case]
    ids = torch.randint(0, 8192, (2, 37), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, ids), _logits(file, ids)
    # within fp32 rounding: Mamba's A_log comes back as log(−A) from the stored −exp(A_log)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_quantized_file_loads_each_tensor_in_its_own_format(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A file mixing formats, as llama-quantize's Q4_K_M does (here every matrix in one
    format, the next in another), loads to the same logits as the same values stored as
    F32: each tensor is read in its own format and put in its place."""
    _, file = converted["qwen3_5-i2-untied"]
    mixed = gguf_fixtures.requantize(file, tmp_path / "mixed.gguf",
                                     gguf_fixtures.cycle_formats())
    types = {t.qtype for t in open_model(mixed).tensors.values()}
    assert set(gguf_fixtures.BLOCK_32) <= types
    flat = gguf_fixtures.dequantized_copy(mixed, tmp_path / "flat.gguf")
    ids = torch.randint(0, 8192, (1, 29), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(mixed, ids), _logits(flat, ids), rtol=0, atol=0)


def test_loading_a_file_leaves_torch_dynamo_unimported(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A start finds the shapes the converter's transforms give without meta-tensor
    arithmetic, whose first call imports ``torch._dynamo`` (1.5 s or more of a start), and
    the native blocks' check likewise. Both forms, in a fresh process as a server is."""
    _, file = converted["qwen3_5-i2-untied"]
    q4 = gguf_fixtures.requantize(file, tmp_path / "q4_0.gguf",
                                   lambda name, shape: GGMLQuantizationType.Q4_0
                                   if len(shape) == 2 and shape[-1] % 32 == 0 else None)
    for path in (file, q4):
        code = ("import sys; from pathlib import Path; from linserve.model import loader; "
                f"loader.load(Path({str(path)!r})); print('torch._dynamo' in sys.modules)")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert run.stdout.strip().splitlines()[-1] == "False", (path.name, run.stderr[-2000:])


def test_a_real_vocabulary_and_template_come_from_the_file(tmp_path: Path) -> None:
    """A Qwen3.5 checkpoint with its published tokenizer and chat template, converted:
    the file's tokenizer encodes as the folder's, ends where it does, and the template is
    the checkpoint's."""
    hf = make_checkpoint(tmp_path / "qwen", "i4-tied")
    file = gguf_fixtures.convert(hf, tmp_path / "qwen.gguf", pre=None, extra=NO_MTP)
    a, b = loader.load(hf, dtype="float32"), loader.load(file, dtype="float32")
    text = "Hello world, <|im_start|>user\nwhat's 2+2? <think>ok</think><|im_end|>"
    assert b.tokenizer().encode(text) == a.tokenizer().encode(text)
    assert set(a.tokenizer().eos_ids) <= set(b.tokenizer().eos_ids)
    assert b.chat_template() == a.chat_template()


def test_a_file_of_an_architecture_not_served_is_one_line(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "x.gguf"), arch="bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'bert' is not served"):
        loader.check(tmp_path / "x.gguf")


@pytest.mark.parametrize("qtype", list(NATIVE), ids=lambda q: q.name)
def test_blocks_multiply_natively_as_they_are(qtype: GGMLQuantizationType) -> None:
    """A matrix in a natively multiplied format (Q4_0, Q8_0, Q4_K, Q5_K, Q4_1, Q5_0, Q5_1)
    goes to the quantized GEMM with its own values and scales: its product is the
    dequantized matrix's (activations quantized as the kernel does) within fp32 rounding,
    and batch-invariant; packing it never quantizes again, and a tied head in it gives each
    token's row back exactly as gguf-py dequantizes it."""
    from linserve.model import kernels
    from linserve.model.gguf.checkpoint import block_values

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    n, k = 150, 512  # a last column vector of 6; two K-quant super-blocks a column
    raw = gguf_fixtures.random_blocks(qtype, n, k, seed=3)
    q, scales = block_values(Tensor("w", (n, k), qtype, raw, raw.nbytes))
    layer = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(quants.dequantize(raw, qtype).reshape(n, k)))
    packing.set_native_blocks(True)
    try:
        packing.give_blocks(layer.weight, packing.Blocks((n, k), NATIVE[qtype], q, scales))
        packed = packing.gemm_weight(layer, layer.weight)
    finally:
        packing.set_native_blocks(False)
    stored = quantize.stored_format(NATIVE[qtype])  # (Q6_K: q6s in six bits, or q6)
    assert quantize.mode_of(packed, k) == {1: "int4", 2: "q8", 3: "q4k", 4: "q8k", 5: "q6",
                                           6: "q4l", 7: "q8l", 8: "q6s"}[stored]
    assert packed.numel() <= quantize.PACKED_BYTES[stored] * n * k // 32 + 4 * n
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))
    full = torch.ops.linserve.invariant_mm(x, packed)
    for i in range(19):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[i:i + 1], packed), full[i:i + 1])
    for rows in (2, 6, 7, 16):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[:rows], packed), full[:rows])
    want = quantize.quantize_activations(x).double() @ layer.weight.detach().double().t()
    assert (full.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    tokens = torch.tensor([0, 17, 149])
    assert torch.equal(torch.ops.linserve.head_rows(packed, tokens, k),
                       layer.weight.detach()[tokens])


def test_q6_k_in_six_bits_multiplies_the_same_at_every_row_count() -> None:
    """Q6_K stored in six bits (q6s) is widened in the tiles for a few rows and once a column
    chunk for many (into a scratch each thread reuses for the chunk's next row groups): over
    several chunks, a partial last panel and two weights in turn, every row count gives each
    row the bits it has alone, within fp32 rounding of the dequantized product; a tied head
    in it gives its rows back exactly."""
    from linserve.model import kernels
    from linserve.model.gguf.checkpoint import block_values

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    q6 = GGMLQuantizationType.Q6_K
    n, k = 1100, 768  # three chunks of columns, the last a partial panel; three super-blocks
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    for seed in (1, 2):  # a second weight of the same shape: no chunk is reused across them
        raw = gguf_fixtures.random_blocks(q6, n, k, seed=seed)
        q, scales = block_values(Tensor("w", (n, k), q6, raw, raw.nbytes))
        packed = torch.ops.linserve.pack_quantized(q.t(), scales.permute(2, 1, 0), 8)
        assert quantize.mode_of(packed, k) == "q6s"
        assert packed.numel() <= quantize.PACKED_BYTES[8] * n * k // 32 + 4 * n
        full = torch.ops.linserve.invariant_mm(x, packed)
        for rows in (1, 2, 5, 6, 7, 13, 16, 39):
            assert torch.equal(torch.ops.linserve.invariant_mm(x[:rows], packed), full[:rows])
        assert torch.equal(torch.ops.linserve.invariant_mm(x[-1:], packed), full[-1:])
        weight = torch.from_numpy(quants.dequantize(raw, q6).reshape(n, k))
        want = quantize.quantize_activations(x).double() @ weight.double().t()
        assert (full.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        tokens = torch.tensor([0, 511, 512, 1099])
        assert torch.equal(torch.ops.linserve.head_rows(packed, tokens, k), weight[tokens])


def test_parts_in_different_formats_run_as_one_mixed_weight() -> None:
    """One product of parts a file stores in different formats (Q4_K_M's Q6_K attn_qkv
    beside its Q4_K attn_gate and ssm_alpha): a mixed weight of each part's own blocks, never
    a dequantized copy; each run of one format's columns are exactly that run's own product
    (the two Q4_K parts are one run), and the whole is batch-invariant."""
    from linserve.model import kernels
    from linserve.model.gguf.checkpoint import block_values

    if not kernels.load():
        pytest.skip("native kernels unavailable")
    k = 512
    shapes = [(GGMLQuantizationType.Q6_K, 70), (GGMLQuantizationType.Q4_K, 40),
              (GGMLQuantizationType.Q4_K, 16), (GGMLQuantizationType.Q5_K, 9)]
    owner, weights, alone = torch.nn.Module(), [], []
    packing.set_native_blocks(True)
    try:
        for i, (qtype, n) in enumerate(shapes):
            raw = gguf_fixtures.random_blocks(qtype, n, k, seed=10 + i)
            q, scales = block_values(Tensor("w", (n, k), qtype, raw, raw.nbytes))
            w = torch.from_numpy(quants.dequantize(raw, qtype).reshape(n, k)).clone()
            packing.give_blocks(w, packing.Blocks((n, k), NATIVE[qtype], q, scales))
            weights.append(w)
            alone.append((q, scales))
        packed = packing.gemm_weight(owner, *weights)
    finally:
        packing.set_native_blocks(False)
    assert quantize.mode_of(packed, k) == "mixed" and packed.shape[1] == 135
    assert packing.pending_blocks() == 0
    assert packed.numel() * 2 < sum(w.numel() for w in weights)  # blocks, not bf16 values
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))
    full = torch.ops.linserve.invariant_mm(x, packed)
    runs = [[alone[0]], [alone[1], alone[2]], [alone[3]]]  # Q6_K, Q4_K, Q5_K
    packs = [torch.ops.linserve.pack_quantized(
        torch.cat([q for q, _ in run]).t(), torch.cat([s for _, s in run]).permute(2, 1, 0),
        NATIVE[qtype]) for run, (qtype, _) in zip(runs, [shapes[0], shapes[1], shapes[3]],
                                                  strict=True)]
    parts = torch.cat([torch.ops.linserve.invariant_mm(x, w) for w in packs], dim=1)
    assert torch.equal(full, parts)
    for rows in (1, 2, 6, 16):
        assert torch.equal(torch.ops.linserve.invariant_mm(x[:rows], packed), full[:rows])
    want = quantize.quantize_activations(x).double() @ torch.cat(weights).double().t()
    assert (full.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0,
                                   GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0],
                         ids=lambda q: q.name)
def test_a_block_file_runs_on_its_blocks_and_dtype_dequantizes(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path,
        qtype: GGMLQuantizationType, auto_dtype: str) -> None:
    """With ``--dtype auto`` (each way this CPU resolves it) a Q4_0, Q8_0, Q4_1 or Q5_0
    file's matrices run on their own blocks (Q4_1 and Q5_0 in the K formats Q4_K and Q5_K
    take: W = s q + t) (its logits track the dequantized model's, the activations quantized
    to int8 as llama.cpp does); ``--dtype float32`` dequantizes at load, giving exactly the
    F32 file's logits."""
    _, file = converted["qwen3_5-i2-untied"]
    q4 = gguf_fixtures.requantize(
        file, tmp_path / "q4_0.gguf",
        lambda name, shape: qtype
        if len(shape) == 2 and shape[-1] % 32 == 0 and "ssm_alpha" not in name else None)
    flat = gguf_fixtures.dequantized_copy(q4, tmp_path / "flat.gguf")
    ids = torch.randint(0, 8192, (1, 33), generator=torch.Generator().manual_seed(5))
    want = _logits(flat, ids)
    torch.testing.assert_close(_logits(q4, ids), want, rtol=0, atol=0)  # float32: dequantized
    native = loader.load(q4, dtype="auto", kv_cache_dtype="fp32")  # the blocks, not the cache
    assert packing.pending_blocks() == 0  # the untied table's blocks were never kept
    # int4 / q8 matrices (the embedding table stays in floats for its lookups)
    ratio = {"Q4_0": 0.7, "Q8_0": 0.8, "Q4_1": 0.75, "Q5_0": 0.85}[qtype.name]
    assert native.info.weight_bytes < ratio * loader.load(flat, dtype="auto").info.weight_bytes
    got = native.prefill(ids, all_logits=True)[0]
    # about as far from the F32 logits as the same file dequantized to bf16 (random blocks
    # make a model whose logits move far with any rounding; the products themselves are
    # checked exact in test_blocks_multiply_natively_as_they_are). The distance is the int8
    # activations' rounding, which on an AVX2 CPU (auto: fp32 around the blocks) measured
    # 2.8x the bf16 copy's for Q4_1 and kept 85% of the argmaxes for Q8_0; a broken kernel
    # moves the logits by their own size.
    in_bf16 = loader.load(q4, dtype="bfloat16").prefill(ids, all_logits=True)[0]
    bound = max(0.15 * want.abs().max().item(), 1.5 * (in_bf16 - want).abs().max().item())
    assert (got - want).abs().max().item() < bound
    agree = (in_bf16.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= min(0.8, agree - 0.15)


@pytest.mark.parametrize("case", ["qwen3_5-i2-untied", "qwen3_5-i3-gqa"])
def test_a_projection_of_mixed_formats_runs_on_its_blocks(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path, case: str,
        auto_dtype: str) -> None:
    """The Gated DeltaNet's input projection of a file that stores attn_qkv in one format and
    attn_gate, ssm_beta and ssm_alpha in another (as Q4_K_M does in every third layer) runs
    on the blocks of each, as one mixed weight, and answers as the file dequantized does;
    also where the converter tiled the value heads (i3-gqa: 3 value heads a key head), whose
    rows carry their blocks back to the checkpoint's order. A step after a prefill gives
    the prefill's last logits in fp32; in bf16 the two round differently (the int8
    activations are quantized from bf16 values), so there the step is held to the
    dequantized file's logits as the prefill is."""
    _, file = converted[case]
    mixed = gguf_fixtures.requantize(
        file, tmp_path / "mixed.gguf",
        lambda name, shape: GGMLQuantizationType.Q5_0 if name.endswith("attn_qkv.weight")
        else GGMLQuantizationType.Q4_0 if name.endswith(("attn_gate.weight", "ssm_beta.weight",
                                                         "ssm_alpha.weight")) else None)
    flat = gguf_fixtures.dequantized_copy(mixed, tmp_path / "flat.gguf")
    native = loader.load(mixed, dtype="auto", kv_cache_dtype="fp32")  # the blocks alone
    assert packing.pending_blocks() == 0
    delta = [m for m in native.module.modules() if hasattr(m, "in_weight")]
    assert delta and all(quantize.mode_of(m.in_weight()) == "mixed" for m in delta)
    ids = torch.randint(0, 8192, (1, 29), generator=torch.Generator().manual_seed(8))
    got, want, bound = _near_the_dequantized(native, mixed, flat, ids, 0.15)
    _, state = native.prefill(ids[:, :-1])
    step = native.step(ids[:, -1], state)
    if auto_dtype == "float32":
        torch.testing.assert_close(step, got[:, -1], rtol=0, atol=1e-4)
    else:
        assert (step - want[:, -1]).abs().max().item() < bound


def test_a_merged_matrix_runs_on_its_parts_blocks(tmp_path: Path, auto_dtype: str) -> None:
    """Granite's shared expert ``shared_mlp.input_linear`` is the file's ffn_gate_shexp and
    ffn_up_shexp stacked by rows: in a Q8_0 file it runs on their blocks stacked, never on
    a dequantized copy, and the model answers as the same file dequantized does."""
    hf = family_fixtures.make(tmp_path / "granite", "granitemoehybrid", "moe-e5k2")
    file = gguf_fixtures.convert(hf, tmp_path / "granite.gguf")
    q8 = gguf_fixtures.requantize(
        file, tmp_path / "q8.gguf", lambda name, shape: GGMLQuantizationType.Q8_0
        if len(shape) == 2 and shape[-1] % 32 == 0 and "shexp" in name else None)
    flat = gguf_fixtures.dequantized_copy(q8, tmp_path / "flat.gguf")
    native = loader.load(q8, dtype="auto", kv_cache_dtype="fp32")  # the blocks alone
    assert packing.pending_blocks() == 0
    from linserve.model.gguf.checkpoint import checkpoint

    blocks = checkpoint(q8).native_blocks("model.layers.0.shared_mlp.input_linear.weight")
    assert blocks is not None and blocks.fmt == NATIVE[GGMLQuantizationType.Q8_0]
    gate = checkpoint(q8).model.tensors["blk.0.ffn_gate_shexp.weight"].shape
    assert blocks.raw is not None and blocks.shape == (2 * gate[0], gate[1])
    assert blocks.raw.shape[0] == 2 * gate[0]  # the parts' rows of blocks, stacked
    # (the shared expert is a small part of this model: its blocks take less than floats)
    assert native.info.weight_bytes < loader.load(flat, dtype="auto").info.weight_bytes
    ids = torch.randint(0, 8192, (1, 21), generator=torch.Generator().manual_seed(6))
    _near_the_dequantized(native, q8, flat, ids, 0.05)


def test_an_unserved_format_or_quantizing_twice_is_one_line(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    _, file = converted["qwen3_5-i2-untied"]
    odd = gguf_fixtures.requantize(
        file, tmp_path / "iq2.gguf", lambda name, shape: GGMLQuantizationType.IQ2_XXS
        if name == "blk.0.ffn_down.weight" else None)
    with pytest.raises(CheckpointError, match="stored as IQ2_XXS, which is not served"):
        loader.check(odd)
    q8 = gguf_fixtures.requantize(file, tmp_path / "q8.gguf", lambda name, shape:
                                  GGMLQuantizationType.Q8_0 if len(shape) == 2
                                  and shape[-1] % 32 == 0 else None)
    with pytest.raises(CheckpointError, match="would quantize them twice"):
        loader.check(q8, quantization="int8")
    loader.check(q8)


def test_a_split_file_loads_from_any_shard(converted: dict[str, tuple[Path, Path]],
                                           tmp_path: Path) -> None:
    """``NAME-0000i-of-0000N.gguf`` shards as gguf-py's writer splits them: naming any shard
    loads the whole model, with the one file's logits; a missing shard is one line."""
    from gguf import GGUFReader, GGUFWriter

    _, file = converted["lfm2-a2-tied"]
    reader = GGUFReader(str(file))
    writer = GGUFWriter(str(tmp_path / "m.gguf"), arch="lfm2", split_max_tensors=7)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    ids = torch.randint(0, 8192, (1, 21), generator=torch.Generator().manual_seed(6))
    want = _logits(file, ids)
    torch.testing.assert_close(_logits(parts[-1], ids), want, rtol=0, atol=0)
    parts[1].unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        loader.check(parts[0])


def test_a_hub_file_resolves_from_the_local_cache(converted: dict[str, tuple[Path, Path]],
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``owner/name:FILE.gguf`` is that file of a Hub repo, read from huggingface_hub's cache
    offline; a file the cache lacks is one line."""
    import huggingface_hub.constants as hub

    _, file = converted["lfm2-a2-tied"]
    repo = tmp_path / "hub" / "models--acme--lfm2-gguf"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "tiny-F32.gguf").write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = loader.resolve("acme/lfm2-gguf:tiny-F32.gguf")
    assert path.name == "tiny-F32.gguf" and loader.family(path).name == "lfm2"
    with pytest.raises(CheckpointError, match="not found in the local Hugging Face cache"):
        loader.resolve("acme/lfm2-gguf:other-Q4_K_M.gguf")


def test_mtp_layers_load_from_the_file(tmp_path: Path) -> None:
    """A Qwen3.5 checkpoint with an MTP layer, converted by llama.cpp's converter (which
    writes it as block n_layer with ``nextn_predict_layers``, its fc and norms as
    ``nextn.*``): the file's model has the same draft head, giving the same drafts as the
    safetensors' for the same hidden states and tokens."""
    from safetensors.torch import load_file, save_file

    from tests.model.qwen_fixtures import add_mtp

    hf = add_mtp(make_checkpoint(tmp_path / "qwen", "i2-untied"))
    tensors = load_file(str(hf / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight"):  # away from 1 (stored as w − 1), so each one matters
        tensors[name] = torch.randn(tensors[name].shape, generator=g) * 0.2
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    file = gguf_fixtures.convert(hf, tmp_path / "qwen.gguf", pre=None)
    assert int(open_model(file).get("nextn_predict_layers")) == 1
    a, b = loader.load(hf, dtype="float32"), loader.load(file, dtype="float32")
    head_a, head_b = a.draft_head(), b.draft_head()
    assert head_a is not None and head_b is not None
    hidden = torch.randn(6, 64, generator=g)
    tokens = torch.randint(0, 8192, (6,), generator=g).tolist()
    want = head_a.extend(head_a.new_state(), hidden, tokens)
    got = head_b.extend(head_b.new_state(), hidden, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(head_b.logits(got), head_a.logits(want), rtol=0, atol=1e-4)
