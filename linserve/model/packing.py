"""GEMM weights as the kernels run them: packed once from a layer's weights (or a GGUF
file's blocks, as they are), kept on the layer, quantized when ``--quantization`` asks,
and released so that a served model holds each weight once. The modes that decide the
format are :mod:`linserve.model.modes`'s; the products on them, :mod:`linserve.model.invariant`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from linserve.model import kernels, modes, quantize


@dataclass(frozen=True)
class Blocks:
    """A weight ``[out, in]`` (``shape``) in blocks the quantized GEMM takes as they are, in
    its format ``fmt``: either their values, q ``[out, in]`` int8 and ``scales`` (see
    :func:`give_blocks`), or ``raw [out, row bytes]`` uint8, a GGUF K-quant matrix's own
    rows of blocks of ggml type ``ggml_type`` (Q4_K, Q5_K, Q6_K), packed natively straight
    from them (``pack_gguf``: the same bytes as from their values, in one pass)."""

    shape: tuple[int, int]
    fmt: int
    q: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    ggml_type: int = 0
    done: Callable[[], None] | None = None  # called once they are packed (pages released)


# A GGUF file's blocks the quantized GEMM takes as they are (linserve.model.gguf.checkpoint's
# NATIVE formats): whether loading keeps them (--dtype auto), and each such weight's blocks
# by its data pointer until it is packed.
_native_blocks = [False]


_block_values: dict[int, Blocks] = {}


# Weights given as blocks alone (their own values not written at load: the packed blocks are
# what runs), by data pointer: the weight and how to compute its values, should anything
# need them as floats after all (fill_values).
_unfilled: dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}


def set_native_blocks(on: bool) -> None:
    """Keep a GGUF file's block-format matrices in their blocks (set by the loader:
    ``--dtype auto`` and no ``--quantization``)."""
    _native_blocks[0] = on
    _block_values.clear()
    _unfilled.clear()


def native_blocks() -> bool:
    return _native_blocks[0]


def give_blocks(weight: torch.Tensor, blocks: Blocks,
                values: Callable[[], torch.Tensor] | None = None) -> None:
    """``weight [out, in]`` holds exactly the values of ``blocks``: q ``[out, in]`` (int8)
    times the fp16 ``scales [out, in / 32]`` (``fmt`` 1: int4, q in [−8, 7]; 2: q8, q in
    [−127, 127]), or s q + t with ``scales [out, in / 32, 4]`` (m_s, m_t, d, e: s = m_s d,
    t = m_t e; 3: q4k, q in [0, 15]; 4: q8k, bytes), or s_h q with the multipliers of each
    half of 32 (5: q6, Q6_K's), or a GGUF K-quant's raw blocks (:class:`Blocks`):
    :func:`gemm_weight` packs them in the GEMM format ``fmt``, never quantizing. With
    ``values``, ``weight`` was left unwritten (the load skips a GGUF matrix's dequantized
    copy): ``values()`` gives its values if it is packed from floats after all (a router,
    a merge of formats), or is never packed by the end of the load (:func:`fill_values`)."""
    _block_values[weight.data_ptr()] = blocks
    if values is not None:
        _unfilled[weight.data_ptr()] = (weight, values)


def _fill(parts: tuple[torch.Tensor, ...]) -> None:
    """Write the values of those ``parts`` given as blocks alone."""
    for p in parts:
        pending = _unfilled.pop(p.data_ptr(), None)
        if pending is not None:
            with torch.no_grad():
                p.copy_(pending[1]().reshape(p.shape))


def fill_values() -> None:
    """Write the values of every weight given as blocks alone that nothing has packed: the
    end of a load, so that a weight read as floats (not by the GEMM) holds its values."""
    for weight, _ in list(_unfilled.values()):
        _fill((weight,))


def pending_blocks() -> int:
    """How many given weights' blocks are still waiting to be packed (0 once a model is
    loaded: each is dropped as its weight is packed)."""
    return len(_block_values)


def pack(w: torch.Tensor, quantized: bool = True) -> torch.Tensor:
    """A GEMM weight stored ``[in, out]`` in the layout the projections run on in this mode:
    column panels that a GEMV reads front to back (``linserve/model/kernels/gemm.h``), shaped
    ``[in, out, 1]``, or ``[in/2, out, 2]`` bf16 pairs for the bf16 dot-product path
    (AVX512-BF16); quantized (:func:`set_quantization`,
    ``linserve/model/kernels/gemm_quant.h``) when a quantization is set, unless not
    ``quantized`` (a router keeps its dtype). Only ``invariant_mm`` and the fused steps read
    it. Outside the mode, or for anything but a
    2-d fp32 / bf16 tensor, ``w`` is returned contiguous."""
    w = w.detach()
    usable = w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float32)
    if usable and quantized and modes.quantization() != "none" and \
            w.shape[0] >= quantize.MIN_INPUTS:
        return quantize.pack(w, modes.quantization())
    w = w.contiguous()
    if modes.enabled() and usable and kernels.load():
        return torch.ops.linserve.pack_weight(w)
    return w


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place version (an optimizer step bumps it); inference tensors have
    none, and cannot be changed in place outside inference mode anyway."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


def gemm_weight(owner: object, *parts: torch.Tensor) -> torch.Tensor:
    """The GEMM weight ``[in, Σ out]`` of one or more ``[out, in]`` weights side by side (one
    product for several projections of the same input), packed (:func:`pack`) and kept on
    ``owner`` until a weight changes (a dtype cast or a load replaces the tensor) or the mode
    flips. Each output column is computed alone, so a stacked product gives every part's
    columns exactly as its own product would. After :func:`release`, the packed weight is
    all there is. An owner whose class sets ``fp32_weights`` (a router) is never quantized."""
    cached = owner.__dict__.get("_invariant_wt")
    if cached is not None and cached[0] is _FROZEN:
        return cast(torch.Tensor, cached[1])
    if any(getattr(p, "_linserve_released", False) for p in parts):
        raise RuntimeError("a released weight has no packed copy on this module "
                           f"({type(owner).__name__}): build it before packing.release")
    key = (modes.enabled(), modes.quantization(),
           *((p.data_ptr(), p.dtype, _version(p)) for p in parts))
    if cached is None or cached[0] != key:
        quantized = not getattr(owner, "fp32_weights", False)
        given = _given_blocks(parts) if quantized else None
        if given is None:
            for p in parts:
                _block_values.pop(p.data_ptr(), None)
            _fill(parts)
        else:
            for p in parts:
                _unfilled.pop(p.data_ptr(), None)
        if given is None:  # the floats, joined only where no blocks were given
            given = pack(_joined([p.detach() for p in parts]).t(), quantized)
        cached = (key, given, parts)
        owner.__dict__["_invariant_wt"] = cached
        if _packing_once[0] is not None:
            _freeze(owner, _packing_once[0])
    return cast(torch.Tensor, cached[1])


def _given_blocks(parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The quantized GEMM weight of ``parts`` side by side, when every part's values were
    given (:func:`give_blocks`): one packed weight where they share a format, else a mixed
    weight of each run of one format (``gemm_mixed.h``: a GGUF file's Q6_K qkv beside its
    Q4_K gate); None otherwise (then packed from the floats). Either way the parts' given
    values are dropped: their weight is packed now."""
    given = [_block_values.pop(p.data_ptr(), None) for p in parts]
    try:
        if not all(given) or not kernels.load():
            return None
        runs: list[list[Blocks]] = []
        for g in given:
            assert g is not None
            if runs and (runs[-1][0].fmt, runs[-1][0].ggml_type) == (g.fmt, g.ggml_type):
                runs[-1].append(g)
            else:
                runs.append([g])
        packed = [_pack_given(run) for run in runs]
    finally:
        for g in given:
            if g is not None and g.done is not None:
                g.done()
    if len(packed) == 1:
        return packed[0]
    return cast(torch.Tensor, torch.ops.linserve.join_quantized(packed))


def _pack_given(run: list[Blocks]) -> torch.Tensor:
    """Given blocks of one format (and one kind) side by side, packed as the quantized
    GEMM's weight."""
    if run[0].ggml_type:  # raw GGUF rows, packed in one native pass
        raw = _joined([cast(torch.Tensor, g.raw) for g in run])
        return cast(torch.Tensor, torch.ops.linserve.pack_gguf(raw, run[0].ggml_type))
    # transposed views: the packer reads them in place (a copy of the head's q into [in,
    # out] took seconds of a start)
    q = _joined([cast(torch.Tensor, g.q) for g in run]).t()
    scales = _joined([cast(torch.Tensor, g.scales) for g in run])  # [out, in/32(, 4)]
    scales = scales.t() if scales.dim() == 2 else scales.permute(2, 1, 0)
    return cast(torch.Tensor, torch.ops.linserve.pack_quantized(q, scales, run[0].fmt))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked by rows (one part as it is, not copied)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def packed(linear: nn.Module) -> torch.Tensor:
    """A linear layer's GEMM weight ``[in, out]`` (:func:`gemm_weight` of its own weight), as
    the native steps take it."""
    return gemm_weight(linear, cast(nn.Linear, linear).weight)


_packing_once: list[set[int] | None] = [None]


@contextlib.contextmanager
def packing_once(module: nn.Module) -> Iterator[None]:
    """Inside, each GEMM weight under ``module`` is frozen (as :func:`release` does) the
    moment it is packed and its original freed, so that packing a loaded checkpoint (a
    warm-up that builds every packed weight) never holds the model twice; :func:`release`
    after, for what was packed before."""
    _packing_once[0] = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    try:
        yield
    finally:
        _packing_once[0] = None
    release(module)


_FROZEN = object()


def release(module: nn.Module) -> None:
    """Keep only the packed GEMM weights built so far under ``module`` (from now on they
    are used whatever the mode), and free the ``nn.Linear`` weights they were packed from:
    each becomes a stride-0 view of one element with its shape (so ``n_params`` still counts
    it). A tied embedding table is freed too when the kernels can read its rows from the
    packed head (:func:`embed`): it is then held once. For a served model
    whose every GEMM weight has been built (a warm-up), so the weights are not held twice."""
    linear = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    for owner in module.modules():
        _freeze(owner, linear)


def _freeze(owner: object, linear: set[int]) -> None:
    """Keep ``owner``'s packed weight whatever the mode, and free the ``nn.Linear`` weights
    (ids in ``linear``) or the tied embedding table it was packed from."""
    cached = owner.__dict__.get("_invariant_wt")
    if cached is None or cached[0] is _FROZEN:
        return
    owner.__dict__["_invariant_wt"] = (_FROZEN, cached[1], ())
    tied = isinstance(owner, nn.Embedding) and kernels.available()
    for p in cached[2]:
        if id(p) in linear or tied:
            _free(p)


def _free(p: torch.Tensor) -> None:
    """Replace a parameter's data by a stride-0 view of one element with its shape."""
    p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)
    p.__dict__["_linserve_released"] = True


def embedding_table(embedding: nn.Embedding) -> torch.Tensor:
    """What a fused step reads token embeddings from: the table, or for a table held once
    (:func:`embed`) the very head tensor (the kernels see it is the head and gather)."""
    head = tied_head(embedding)
    return embedding.weight.detach() if head is None else head


def tied_head(embedding: nn.Embedding) -> torch.Tensor | None:
    if not getattr(embedding.weight, "_linserve_released", False):
        return None
    return frozen(embedding)


def strip(module: nn.Module) -> None:
    """Free every parameter and packed GEMM weight under ``module`` (each parameter becomes
    a stride-0 view of one element with its shape): what is left describes the model and
    cannot run it (:func:`gemm_weight` refuses, as after :func:`release`)."""
    for owner in module.modules():
        owner.__dict__.pop("_invariant_wt", None)
    for p in module.parameters():
        p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)
        p.__dict__["_linserve_released"] = True


def frozen(owner: object) -> torch.Tensor | None:
    """``owner``'s packed GEMM weight if :func:`release` kept it, else None."""
    cached = owner.__dict__.get("_invariant_wt")
    return cast(torch.Tensor, cached[1]) if cached is not None and cached[0] is _FROZEN \
        else None


def resident_bytes(module: nn.Module, extra: Iterable[torch.Tensor] = ()) -> int:
    """Bytes the weights of ``module`` hold: its parameters' storages, the packed GEMM
    weights on its modules and the ``extra`` tensors, each storage counted once."""
    cached = [c[1] for o in module.modules() if (c := o.__dict__.get("_invariant_wt"))]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*module.parameters(), *cached, *extra]}
    return sum(seen.values())


def embedding_bytes(module: nn.Module) -> int:
    """Bytes of the embedding tables under ``module`` still held as tables (a tied table
    held once as its head counts nothing here)."""
    return sum(m.weight.untyped_storage().nbytes() for m in module.modules()
               if isinstance(m, nn.Embedding) and not getattr(m.weight, "_linserve_released",
                                                              False))
