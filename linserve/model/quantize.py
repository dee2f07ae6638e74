"""Weight quantization at load time (``--quantization int8|int4``).

Every GEMM weight (the projections, the MLP and the output head, which a tied model's token
embeddings are read from too; not an untied embedding table, not the norms) is replaced by
small integers and scales, and multiplied by ``linserve/model/kernels/gemm_quant.h`` without ever
being dequantized in memory. The products are
integer dot products: a GEMM's input is quantized on the fly, per row and block of
:data:`GROUP` inputs, to int8 (:func:`quantize_activations`, llama.cpp's Q8_0 rule, which
its Q8_0 and Q4_0 dot products use too); the sums of blocks are fp32. Everything between
GEMMs, recurrent states and KV caches stay fp32.

- **int8**: symmetric, one fp32 scale per output channel: ``W[k, n] ≈ q[k, n] · s[n]``,
  ``s[n] = max_k |W[k, n]| / 127``, q in [−127, 127]. 8.0 bits a weight (+ 32 a column).
- **int4**: symmetric, one fp16 scale per group of :data:`GROUP` input features and output
  channel, as llama.cpp's Q4_0: the weight of largest magnitude in the group maps to −8,
  ``s = that weight / −8``, ``q = round(W / s)`` clamped to [−8, 7]. 4.5 bits a weight.
  A weight whose input size is not a multiple of the group falls back to int8; one with
  fewer than :data:`MIN_INPUTS` inputs is not quantized.

The functions here work on GEMM weights stored ``[in, out]`` (``K × N``), the layout
:func:`linserve.model.packing.pack` receives.
"""

from __future__ import annotations

import torch

from linserve.model import kernels

MODES = ("none", "int8", "int4")
GROUP = 32  # int4 group size along the input features (llama.cpp Q4_0's block)
# Weights with fewer input features stay unquantized: low-rank factors (the gated models'
# rank-4 gate_up, [4, 64]) whose bytes do not matter, and which the fused steps read as fp32.
MIN_INPUTS = 32
# A wide weight (a 250k-vocabulary head) is quantized and packed this many output columns at
# a time (a multiple of every build's column panel), then assembled: quantizing it whole
# took fp32 and int32 copies of all of it, 2.5 GB beside a 0.5 GB head at load's peak.
CHUNK = 8192


def check_mode(mode: str) -> None:
    """Raise ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r} (one of {', '.join(MODES)})")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [K, N]`` -> q ``[K, N]`` int8 in [−127, 127] and fp32 scales ``[N]``."""
    w = w.to(torch.float32, copy=True)  # scaled in place: one fp32 copy at a time
    scale = w.abs().amax(0) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = w.mul_(inv).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [K, N]`` (K a multiple of ``group``) -> q ``[K, N]`` int8 in [−8, 7] and fp16
    scales ``[K / group, N]``."""
    k, n = w.shape
    g = w.to(torch.float32, copy=True).view(k // group, group, n)  # scaled in place
    extreme = g.gather(1, g.abs().argmax(1, keepdim=True)).squeeze(1)  # [K/G, N], signed
    scale = (extreme / -8).half()
    s = scale.float()
    inv = torch.where(s != 0, 1 / s, torch.zeros_like(s))
    q = g.mul_(inv[:, None, :]).round_().clamp_(-8, 7).to(torch.int8).view(k, n)
    return q, scale


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [B, K]`` as the quantized GEMM sees it: per row and block of :data:`GROUP` inputs,
    ``s = max |x| / 127`` and ``x ≈ round(x / s) · s`` (ties to even; the kernel's rule, the
    tests' reference)."""
    b, k = x.shape
    pad = -k % GROUP
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).view(b, -1, GROUP)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(blocks / s).clamp(-127, 127), torch.zeros_like(blocks))
    return (q * s).view(b, -1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``[K, N]`` that ``(q, scale)`` stands for (the reference for tests)."""
    if scale.dim() == 1:
        return q.float() * scale.float()
    k, n = q.shape
    groups = scale.shape[0]
    return (q.float().view(groups, k // groups, n) * scale.float()[:, None, :]).view(k, n)


def quantize(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [K, N]`` quantized for ``mode`` (int4 falls back to int8 where K is not a multiple
    of :data:`GROUP`)."""
    check_mode(mode)
    if mode == "int4" and w.shape[0] % GROUP == 0:
        return quantize_int4(w)
    return quantize_int8(w)


def pack(w: torch.Tensor, mode: str) -> torch.Tensor:
    """``w [K, N]`` fp32 / bf16 -> the stored quantized weight the invariant GEMM multiplies
    (``linserve/model/kernels/gemm_quant.h``: an int8 tensor for int8, uint8 for int4; ``shape[1]``
    is N). Needs the native kernels."""
    if not kernels.load():
        raise RuntimeError("quantized weights need the native kernels, which did not load "
                           f"({kernels.load_error() or 'unavailable'})")
    k, n = w.shape
    if n <= CHUNK:
        q, scale = quantize(w.detach(), mode)
        return torch.ops.linserve.pack_quantized(q, scale, int(scale.dim() == 2))
    first = pack(w[:, :CHUNK], mode)
    int4 = first.dtype == torch.uint8
    out = torch.zeros(first.shape[0], n, 4, dtype=first.dtype)
    flat, at_scales = out.view(-1), (k + GROUP - 1) // GROUP * GROUP * n
    for c in range(0, n, CHUNK):  # one chunk's packed copy at a time beside the whole
        part = first if c == 0 else pack(w[:, c : c + CHUNK], mode)
        width, bytes_ = part.shape[1], part.view(-1)
        if int4:  # every column's panels in order: one contiguous stretch a chunk
            body = (k // GROUP) * 18 * width
            flat[(k // GROUP) * 18 * c :][:body] = bytes_[:body]
        else:  # the panels, then fp32 scales [N] after all of them
            panels = (k + GROUP - 1) // GROUP * GROUP * width
            flat[panels // width * c :][:panels] = bytes_[:panels]
            flat[at_scales + 4 * c :][: 4 * width] = bytes_[panels : panels + 4 * width]
    return out


# The block-scaled stored formats of linserve/model/kernels/gemm_quant.h (its QFormat, which
# pack_quantized takes), and the bytes a column's block of 32 inputs takes in each (its
# block_bytes): int4 for --quantization int4 and Q4_0, the others for a GGUF file's blocks.
# (The K formats' blocks of 32 take 18 or 34 bytes and their super-block's fp32 pair 8 more
# a super-block: of 8 blocks for the K-quants, of one for q4l and q8l, the legacy blocks.)
# Q6_K's values go to format 5 and are stored as q6 (bytes) on VNNI builds and as q6s (six
# bits) on the others: stored_format.
BLOCK_FORMATS = {"int4": (1, 18), "q8": (2, 34), "q4k": (3, 19), "q8k": (4, 35), "q6": (5, 35),
                 "q4l": (6, 26), "q8l": (7, 42), "q6s": (8, 27)}
PACKED_BYTES = dict(BLOCK_FORMATS.values())  # format number -> bytes a column's block


def stored_format(fmt: int) -> int:
    """The format a weight given to the kernels as ``fmt`` is stored in on this build (Q6_K's
    5: 8 where the kernels store it in six bits); ``fmt`` itself where they are not loaded."""
    if fmt == 5 and kernels.is_loaded():
        return int(torch.ops.linserve.stored_format(fmt))
    return fmt


def mode_of(packed: torch.Tensor, k: int | None = None) -> str:
    """The quantization of a weight as :func:`pack` or :func:`linserve.model.packing.pack` left
    it: ``int8``, ``int4``, ``none``, or (a GGUF file's blocks, told apart by the stored
    rows of its ``k`` inputs) ``q8``, ``q4k``, ``q8k``, ``q6``, ``q6s``, ``q4l`` or ``q8l``, or
    ``mixed`` (parts of several of those side by side: ``gemm_mixed.h``)."""
    if packed.dtype == torch.int16:
        return "mixed"
    if k is not None and k % GROUP == 0 and packed.dtype in (torch.uint8, torch.int8):
        stored_as_int8 = ("q6", "q6s")  # (q8k, kByte, has q6's size: gemm_quant.h's quant_format)
        for name, (_, size) in BLOCK_FORMATS.items():
            if name == "int4" or (name in stored_as_int8) != (packed.dtype == torch.int8):
                continue
            if name in ("q4k", "q8k", "q6", "q6s") and k % 256:  # the K-quants' super-blocks
                continue
            if packed.shape[0] == (k // GROUP * size + 3) // 4:
                return name
    return {torch.int8: "int8", torch.uint8: "int4"}.get(packed.dtype, "none")
