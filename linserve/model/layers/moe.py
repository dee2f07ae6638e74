"""A sparse mixture of SwiGLU experts: a router picks ``top_k`` of ``experts`` for each token,
the chosen experts run on the tokens that chose them, and their outputs are summed with the
router's weights; optionally a shared expert (Qwen's, gated by a sigmoid; Granite's shared
MLP and Nemotron-H's shared expert, ungated) runs on every token. Experts are SwiGLU, or
Nemotron-H's squared-ReLU MLPs (``act="relu2"``), optionally between a latent down- and
up-projection (Nemotron-H's ``moe_latent_size``).

Only the chosen experts' weights are read: the tokens of a step or a prompt are grouped by
expert, so each chosen expert runs one product over its tokens (a grouped GEMM, expert after
expert) and an expert nobody chose is never touched. Batch-invariant: a token's routing is its
own row of the router's product; each expert's product is the invariant GEMM (a row's output
does not depend on the rows beside it); and a token's outputs are added in ascending expert
order, as transformers adds them, whatever the other tokens chose. The whole-model native
step (``linserve/model/kernels/moe.h``) computes the same thing for the families built on
:mod:`linserve.model.layers.decoder`.

Parameters, as the checkpoints name them after a family's renames: ``gate`` (the router,
``[experts, d]``, never quantized), ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``,
``gate.expert_bias`` (LFM2-MoE's and Nemotron-H's correction bias, for choosing only),
``shared_expert``, ``shared_expert_gate`` and ``fc1_latent_proj`` / ``fc2_latent_proj``.
Checkpoints that stack the experts (``experts.gate_up_proj [E, 2I, d]``,
``experts.up_proj [E, I, d]``, ``experts.down_proj [E, d, I]``) are split into these by
:func:`split_stacked`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear
from linserve.model.layers.mlp import ReluSquaredMLP, SwiGLU

SCORING = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}  # moe.h's Router::scoring
EMPTY = torch.empty(0)


@dataclass(frozen=True)
class RouterSpec:
    """How a family routes. ``scoring``:

    - ``"softmax"``: probabilities over all experts, then the top k (Qwen);
    - ``"sigmoid"``: independent sigmoids, then the top k (LFM2-MoE), chosen by the scores
      plus ``expert_bias`` when the family has one;
    - ``"softmax_topk"``: the top k logits, then a softmax over those (Granite, Mixtral).

    ``norm_topk``: the chosen weights divided by their sum (plus ``norm_eps``);
    ``scaling``: then multiplied by ``routed_scaling_factor``.

    ``groups`` > 1 (Nemotron-H's ``n_group``, DeepSeek-V3's group-limited routing): the
    experts fall in equal groups, each scored by the sum of its two best choosing scores,
    and only the ``topk_groups`` best groups' experts may be chosen."""

    experts: int
    top_k: int
    scoring: str = "softmax"
    norm_topk: bool = True
    norm_eps: float = 0.0
    scaling: float = 1.0
    expert_bias: bool = False
    groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid", "softmax_topk"):
            raise ValueError(f"unknown router scoring {self.scoring!r}")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} is not in 1..{self.experts} experts")
        if self.groups > 1 and (self.experts % self.groups or self.experts // self.groups < 2
                                or not 0 < self.topk_groups <= self.groups
                                or self.scoring == "softmax_topk"):
            raise ValueError(f"cannot route {self.experts} experts in {self.groups} groups, "
                             f"top {self.topk_groups} groups")


def keep_top_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """``choice`` ``[N, E]`` with every expert outside each row's ``keep`` best groups set to
    -inf; a group's score is the sum of its two best experts' (as transformers' Nemotron-H
    and DeepSeek-V3 routers score them)."""
    rows, n = choice.shape
    grouped = choice.view(rows, groups, n // groups)
    score = grouped.topk(2, dim=-1).values.sum(-1)
    best = torch.topk(score, keep, dim=-1, sorted=False).indices
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(rows, n)


class Router(Linear):
    """The router's product ``[d] -> [experts]`` fp32: fp32 weights whatever the served
    dtype (:func:`linserve.model.architectures.hf.cast`), never quantized (a few bits moved in a
    router's logits change which experts a token reads). ``expert_bias`` ``[experts]``:
    LFM2-MoE's bias for choosing, when the family has one."""

    fp32_weights = True  # read by hf.cast (kept fp32) and packing.gemm_weight (unquantized)

    def __init__(self, dim: int, experts: int, expert_bias: bool = False) -> None:
        super().__init__(dim, experts, bias=False)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float())


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, fp32, batch-invariant (see
    :func:`invariant.rowwise` and :func:`invariant.sum_last`)."""
    x = x.float()
    e = invariant.rowwise(torch.exp, x - x.amax(-1, keepdim=True))
    return e / invariant.sum_last(e)


def _mlp(act: str, dim: int, hidden: int, bias: bool = False, fused: bool = False
         ) -> SwiGLU | ReluSquaredMLP:
    if act == "relu2":
        return ReluSquaredMLP(dim, hidden, bias)
    if act != "swiglu":
        raise ValueError(f"unknown expert activation {act!r}")
    return SwiGLU(dim, hidden, bias, fused=fused)


@dataclass(frozen=True)
class ExpertsSpec:
    """The experts' form: ``act`` ``"swiglu"`` or ``"relu2"`` (``down(relu(up(x))²)``), for
    the routed and the shared experts alike; ``latent``: the width the routed experts run
    at between ``fc1_latent_proj`` and ``fc2_latent_proj`` (0: the model's);
    ``bias``: biases on the shared expert and the latent projections."""

    act: str = "swiglu"
    latent: int = 0
    bias: bool = False


@dataclass
class NativeMoE:
    """A :class:`SparseMoE` as moe.h takes it: its seven weight slots (router ``[d, E]``
    fp32, expert bias ``[E]``, the shared expert's gate_up or up and down, its gate
    ``[d, 1]``, the latent projections in and out; absent ones empty), every expert's
    (gate_up or up, down) GEMM weights in order, top k, the router's bits
    (:meth:`SparseMoE.native_flags`), the top-k norm's eps and the routed scaling."""

    weights: list[torch.Tensor]
    experts: list[torch.Tensor]
    top_k: int
    flags: int
    norm_eps: float
    scaling: float


class SparseMoE(nn.Module):
    """``fc2(Σ_k w_k · expert_k(fc1(x))) [+ shared(x) (· sigmoid(shared_gate(x)))]``, the
    router reading x itself. ``[..., d] -> [..., d]`` in x's dtype.

    Where the kernels are built, inference runs natively (``moe_forward``: moe.h, which the
    whole-model decode steps call too): tokens grouped by expert in C++, activations fp32
    between the products. The PyTorch form below is the reference (``native = False``)."""

    native = True

    def __init__(self, dim: int, hidden: int, spec: RouterSpec, shared: int = 0,
                 shared_gate: bool = False, shared_fused: bool = False,
                 form: ExpertsSpec = ExpertsSpec()) -> None:
        super().__init__()
        self.spec, self.form = spec, form
        inner = form.latent or dim
        self.gate = Router(dim, spec.experts, spec.expert_bias)
        self.experts = nn.ModuleList(_mlp(form.act, inner, hidden)
                                     for _ in range(spec.experts))
        self.shared_expert = _mlp(form.act, dim, shared, form.bias, shared_fused) \
            if shared else None
        self.shared_expert_gate = Router(dim, 1) if shared and shared_gate else None
        if form.latent:
            self.fc1_latent_proj = Linear(dim, inner, bias=form.bias)
            self.fc2_latent_proj = Linear(inner, dim, bias=form.bias)

    def build_weights(self) -> None:
        """Build every expert's packed weights (a forward on one zero row each), so that a
        load packs them all, layer by layer, not only the experts a warm-up chose."""
        zero = torch.zeros(1, self.gate.in_features,
                           dtype=next(self.experts.parameters()).dtype)
        self.gate(zero)
        inner = self.fc1_latent_proj(zero) if self.form.latent else zero
        for expert in self.experts:
            expert(inner)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, d]`` -> (weights ``[N, k]`` in x's dtype, chosen experts ``[N, k]``)."""
        spec = self.spec
        logits = self.gate(x)
        if spec.scoring == "softmax_topk":
            top, chosen = logits.float().topk(spec.top_k, dim=-1)
            return softmax_rows(top).to(x.dtype), chosen
        if spec.scoring == "softmax":
            scores = softmax_rows(logits)
        else:
            scores = invariant.rowwise(torch.sigmoid, logits)
        if spec.expert_bias or spec.groups > 1:
            choice = scores + self.gate.get_buffer("expert_bias") if spec.expert_bias \
                else scores
            if spec.groups > 1:
                choice = keep_top_groups(choice, spec.groups, spec.topk_groups)
            _, chosen = torch.topk(choice, spec.top_k, dim=-1)
            top = scores.gather(1, chosen)
        else:
            top, chosen = torch.topk(scores, spec.top_k, dim=-1)
        if spec.norm_topk:
            total = invariant.sum_last(top)
            top = top / (total + spec.norm_eps if spec.norm_eps else total)
        if spec.scaling != 1.0:
            top = top * spec.scaling
        return top.to(x.dtype), chosen

    def native_flags(self) -> int:
        """moe.h's Router in bits: scoring (0-1), norm_topk (2), relu2 (3), latent (4),
        groups (8-15), topk_groups (16-23)."""
        spec, form = self.spec, self.form
        return (SCORING[spec.scoring] + 4 * int(spec.norm_topk) + 8 * int(form.act == "relu2")
                + 16 * int(bool(form.latent)) + (spec.groups << 8) + (spec.topk_groups << 16))

    def native_args(self) -> NativeMoE | None:
        """The layer as moe.h takes it (the packed weights the PyTorch form uses, so nothing
        is held twice); None for a form moe.h lacks (biased experts or latent
        projections, more than 255 groups)."""
        spec, form = self.spec, self.form
        experts = [cast(SwiGLU | ReluSquaredMLP, e).native_weights() for e in self.experts]
        shared = [EMPTY, EMPTY] if self.shared_expert is None \
            else self.shared_expert.native_weights()
        if shared is None or any(e is None for e in experts) or spec.groups > 255 or (
                form.latent and form.bias):
            return None
        bias = self.gate.get_buffer("expert_bias").detach().float().contiguous() \
            if spec.expert_bias else EMPTY
        gate = EMPTY if self.shared_expert_gate is None \
            else packing.packed(self.shared_expert_gate)
        latent = [packing.packed(self.fc1_latent_proj),
                  packing.packed(self.fc2_latent_proj)] if form.latent else [EMPTY, EMPTY]
        return NativeMoE([packing.packed(self.gate), bias, *shared, gate, *latent],
                         [w for e in experts if e is not None for w in e], spec.top_k,
                         self.native_flags(), spec.norm_eps, spec.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        args = self.native_args() if self.native and kernels.available() \
            and not torch.is_grad_enabled() else None
        if args is not None:
            out = torch.ops.linserve.moe_forward(
                flat.float().contiguous(), args.weights, args.experts, args.top_k,
                args.flags, args.norm_eps, args.scaling)
            return out.to(x.dtype).view(shape)
        weights, chosen = self.route(flat)
        out = self._routed(self.fc1_latent_proj(flat) if self.form.latent else flat,
                           weights, chosen)
        if self.form.latent:
            out = self.fc2_latent_proj(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                gate = invariant.rowwise(torch.sigmoid, self.shared_expert_gate(flat))
                shared = gate * shared
            out = out + shared.to(out.dtype)
        return out.view(shape)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                ) -> torch.Tensor:
        """``Σ_k w_k · expert_k(x)``, x ``[N, d']``, weights and chosen ``[N, k]``."""
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # one token (a batch-1 step): its k experts, no grouping
            for k, expert in sorted(enumerate(chosen[0].tolist()), key=lambda p: p[1]):
                y = self.experts[expert](x) * weights[:, k, None]
                out += y.to(out.dtype)  # the same additions, in the same order, as below
        else:  # grouped by expert, in ascending order: each chosen expert's weights read once
            for e in torch.unique(chosen).tolist():
                rows, slot = torch.where(chosen == e)
                y = self.experts[e](x[rows]) * weights[rows, slot, None]
                out.index_add_(0, rows, y.to(out.dtype))
        return out


_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


# a part of a checkpoint tensor, as the loader takes it (model.architectures.hf.Index)
Part = tuple[int | slice | torch.Tensor, ...] | None


def split_stacked(name: str, shape: tuple[int, ...]) -> list[tuple[str, Part]] | None:
    """For a checkpoint tensor that stacks every expert (``….experts.gate_up_proj``
    ``[E, 2I, d]``, gate rows first, or ``….experts.down_proj`` ``[E, d, I]``, as
    transformers' fused layout and Granite's ``input_linear`` / ``output_linear`` store
    them; or ``….experts.up_proj`` ``[E, I, d]``, Nemotron-H's squared-ReLU experts): each
    expert's parameter and the index of its part. None for any other name."""
    hit = _STACKED.match(name)
    if hit is None or len(shape) != 3:
        return None
    prefix, kind = hit.groups()
    if kind != "gate_up_proj":
        return [(f"{prefix}.{e}.{kind}.weight", (e,)) for e in range(shape[0])]
    half = shape[1] // 2
    pieces: list[tuple[str, Part]] = [piece for e in range(shape[0]) for piece in (
        (f"{prefix}.{e}.gate_proj.weight", (e, slice(0, half))),
        (f"{prefix}.{e}.up_proj.weight", (e, slice(half, shape[1]))))]
    return pieces
