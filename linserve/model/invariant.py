"""Batch-invariant inference: a row's logits do not depend on the rows beside it.

oneDNN and MKL choose kernels, blockings and reduction orders by the shape of the whole
product, so one request's logits move in their last bits with the number of requests that
share its step or its ragged prefill, and a seeded sample flips where a uniform lands on a
CDF boundary. In this mode every linear layer of the inference forms (eager prefill, eager
step, the LM head, and the fused steps' projections) runs ``linserve/model/kernels/gemm.h``: each
output element is one fp32 accumulator over the input features in order, whatever the batch.
Chunked attention runs fixed chunk shapes (:func:`chunk_len`), so a prompt's chunks are the
same matrices alone or padded into a ragged batch.

The mode is process-wide (the engine sets it once at start, ``--batch-invariant``) and on by
default. Training and autograd never use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import kernels, modes, packing


def packed_gemm() -> bool:
    """Whether linear layers run the packed GEMM: in this mode, or with quantized weights."""
    return (modes.active() or ((modes.quantization() != "none" or packing.native_blocks())
                         and kernels.available() and not torch.is_grad_enabled()))


def chunk_len(chunk_size: int, t: int) -> int:
    """The chunk length of the chunked attention forms for ``t`` tokens: the full
    ``chunk_size`` in this mode (fixed shapes), else no longer than the sequence."""
    return chunk_size if modes.active() else min(chunk_size, t)


def embed(embedding: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """``embedding(tokens)`` ``[..., d]`` in the table's dtype. A tied table whose head
    :func:`release` kept is held once, as that head: rows are then read from it
    (``head_rows``, ``linserve/model/kernels/embed.h``; a quantized head gives its dequantized
    values, as llama.cpp's quantized ``token_embd``)."""
    head = packing.tied_head(embedding)
    if head is None:
        return embedding(tokens)
    rows = torch.ops.linserve.head_rows(head, tokens.reshape(-1), embedding.embedding_dim)
    return rows.view(*tokens.shape, -1).to(embedding.weight.dtype)


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ w`` for ``w`` from :func:`gemm_weight`: the invariant GEMM (fp32 out)
    for a packed weight or when :func:`active`, else ATen in x's dtype, as ``F.linear``
    would."""
    if w.dim() == 2 and not modes.active():
        return x @ w.to(x.dtype)
    flat = x.reshape(-1, x.shape[-1]).float()
    return torch.ops.linserve.invariant_mm(flat, w).view(*x.shape[:-1], w.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, owner: object,
           bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x ``[..., in]``, batch-invariant when :func:`active`
    and the weight is fp32 or bf16. The result has x's dtype, as F.linear's would, or with
    ``fp32_out`` is fp32 and x may be of any float dtype: the invariant GEMM takes fp32 rows
    and gives fp32, so a layer that works in fp32 around it need not round to the model's
    dtype and back (Mamba2's projections: two full-size copies each)."""
    kept = packing.frozen(owner)
    if kept is None and (not packed_gemm() or weight.dtype not in (torch.float32,
                                                                   torch.bfloat16)):
        if not fp32_out:
            return F.linear(x, weight, bias)
        return F.linear(x.to(weight.dtype), weight, bias).float()
    y = project(x, kept if kept is not None else packing.gemm_weight(owner, weight))
    if bias is not None:
        y = y + bias.float()
    return y if fp32_out else y.to(x.dtype)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [K, N]``, batch-invariant when :func:`active` (for small matrices
    built per call, such as FAVOR+'s feature projection; layers use :class:`Linear`)."""
    if not modes.active() or w.dtype not in (torch.float32, torch.bfloat16):
        return x @ w
    flat = x.reshape(-1, x.shape[-1]).float()
    y = torch.ops.linserve.invariant_mm(flat, w.contiguous())
    return y.to(torch.promote_types(x.dtype, w.dtype)).view(*x.shape[:-1], w.shape[1])


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each head's own product: x ``[..., H, K]`` fp32 and w ``[H, K, N]`` -> ``[..., H, N]``
    (block-diagonal weights: Griffin's gates, MLA's absorbed key and value maps),
    batch-invariant when :func:`active` (a :func:`matmul` a head)."""
    w = w.float()
    if modes.active():
        return torch.stack([matmul(x[..., h, :], w[h]) for h in range(w.shape[0])], dim=-2)
    return torch.einsum("...hk,hkn->...hn", x, w)


# ATen's vectorised loops run two vectors per iteration (2 x 16 fp32 lanes on AVX-512, 2 x 8 on
# AVX2) and leave the rest to a scalar loop: rows padded to 32 never reach that tail.
LANES = 32


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` for an elementwise ``fn`` (exp, sigmoid, silu, softplus, cos ...), made
    batch-invariant: ATen computes most of a tensor with vectorised approximations and its
    tail with scalar ones, which differ in the last bits, so an element's value depends on
    where it falls in the whole tensor. When :func:`active` and the last dimension is not a
    multiple of :data:`LANES`, every row is padded to one, so each element sits in the same
    lane whatever the batch, and nothing falls in a tail. xs share one shape."""
    n = xs[0].shape[-1]
    if not modes.active() or n % LANES == 0:
        return fn(*xs)
    pad = (-n) % LANES
    return fn(*(F.pad(x, (0, pad)) for x in xs))[..., :n]


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1, keepdim=True)`` in fp32, batch-invariant when :func:`active` (a product with
    a column of ones: one accumulator per row, in order). ATen's reductions over a short last
    dimension vectorise across rows when there are many, so a row's sum would depend on the
    rows beside it."""
    xf = x.float()
    if not modes.active():
        return xf.sum(-1, keepdim=True)
    flat = xf.reshape(-1, x.shape[-1]).contiguous()
    ones = torch.ones(x.shape[-1], 1)
    return torch.ops.linserve.invariant_mm(flat, ones).view(*x.shape[:-1], 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal softmax(q kᵀ / √D) v: query row t of T attends keys 0 … ``start`` + t. q
    ``[B, H, T, D]``, k, v ``[B, Hkv, S, D]`` (S ≥ start + T; H a multiple of Hkv:
    grouped-query attention, no key copies), fp32 -> ``[B, H, T, D]``. When :func:`active`,
    natively, each row over its own keys alone (``attend_causal``, the decode steps'
    arithmetic), so a row's output depends on that row and its keys, not on how many rows
    share the call (a prompt prefilled whole or in chunks gives the same bits); else SDPA."""
    t, s = q.shape[2], k.shape[2]
    if not modes.active():
        mask = torch.ones(t, s, dtype=torch.bool).tril(start)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])
    o = torch.ops.linserve.attend_causal(q.transpose(1, 2).contiguous(), k, v, start)
    return o.transpose(1, 2)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose inference forward is
    batch-invariant when the mode is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self, self.bias)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with an fp32 result, x of any float dtype (see :func:`linear`)."""
        return linear(x, self.weight, self, self.bias, fp32_out=True)


def prefill_split(todo: int, cap: int, budget: int, chunk: int) -> int:
    """How many of ``todo`` prompt tokens to prefill now, under a per-call ``cap`` and the
    iteration's ``budget``. In this mode a prompt is split only at multiples of ``chunk``
    from its start, so its chunks are the same whatever else the iteration holds: a budget
    too small for a whole chunk gives 0 (wait for the next iteration). A ``cap`` below one
    chunk cannot align and is used as it is."""
    n = min(todo, cap, budget)
    if not (modes.enabled() and kernels.available()) or n == todo:
        return n
    aligned = n - n % chunk
    if aligned or cap < chunk:
        return aligned or n
    return 0
