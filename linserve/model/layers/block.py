"""The common pre-norm residual layer of the decoder families (:class:`Block`), the mixer
interface it calls, and :func:`build_weights`. Its own module so that both the decoder
(:mod:`linserve.model.layers.decoder`) and the native step's planner
(:mod:`linserve.model.layers.native_step`) import it, and neither imports the other's
importer."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn


class Mixer(Protocol):
    def __call__(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                 new: torch.Tensor | None = None) -> torch.Tensor: ...

    def step(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor
             ) -> torch.Tensor: ...

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]: ...


class LayerPart(NamedTuple):
    """One part of a layer as the native step composes it: ``h = pre(x)`` (x where ``pre``
    is None), ``y = post(module(h))`` (``module(h)`` where ``post`` is None), then
    ``x = a·(h if from_normed else x) + b·y``. ``module`` None: the part is absent."""

    module: nn.Module | None
    pre: nn.Module | None = None
    post: nn.Module | None = None
    from_normed: bool = False
    a: float = 1.0
    b: float = 1.0


@torch.inference_mode()
def build_weights(module: nn.Module) -> None:
    """Build the packed weights a warm-up on one input does not reach: those of every
    submodule with a ``build_weights`` method (the experts a router did not choose)."""
    for m in module.modules():
        build = getattr(m, "build_weights", None)
        if m is not module and callable(build):
            build()


class Block(nn.Module):
    """``x + r·mixer(norm(x))``, then ``x + r·mlp(norm(x))`` (either part may be absent, as
    in Nemotron-H's single-purpose blocks); r is Granite's ``residual_multiplier``. A
    feed-forward may stand in the mixer's place (Nemotron-H's MLP and MoE blocks): a module
    without ``new_entries`` is called on the normed rows alone and holds no state.
    ``sandwich``: each part's output is normed too before it joins x (LFM3's
    ``use_sandwich_norm``); without ``pre_norms`` only after (OLMo's post-norm blocks).
    Parameter names: ``input_layernorm``, ``mixer``, ``post_attention_layernorm``, ``mlp``
    (and ``post_mixer_norm``, ``post_mlp_norm``)."""

    def __init__(self, mixer: nn.Module | None, mlp: nn.Module | None,
                 norm: type[nn.Module] | Any, dim: int, eps: float,
                 residual_scale: float = 1.0, sandwich: bool = False,
                 pre_norms: bool = True) -> None:
        super().__init__()
        self.sandwich = sandwich or not pre_norms
        self.pre_norms = pre_norms
        self.post_mixer_norm: Any
        self.post_mlp_norm: Any
        if self.sandwich and mixer is not None:
            self.post_mixer_norm = norm(dim, eps)
        if self.sandwich and mlp is not None:
            self.post_mlp_norm = norm(dim, eps)
        self.mixer: Any
        self.mlp: Any
        if mixer is not None:
            self.input_layernorm = norm(dim, eps) if pre_norms else nn.Identity()
            self.mixer = mixer
        if mlp is not None:
            self.post_attention_layernorm = norm(dim, eps) if pre_norms else nn.Identity()
            self.mlp = mlp
        self.has_mixer, self.has_mlp = mixer is not None, mlp is not None
        self.stateful = hasattr(mixer, "new_entries")
        self.residual_scale = residual_scale

    def new_entries(self, batch: int, max_context: int) -> dict[str, Any]:
        return self.mixer.new_entries(batch, max_context) if self.stateful else {}

    def native_parts(self) -> tuple[LayerPart, LayerPart]:
        """The mixer and the MLP as the native step composes them (:class:`LayerPart`)."""
        def part(present: bool, name: str, pre: str, post: str) -> LayerPart:
            if not present:
                return LayerPart(None)
            return LayerPart(getattr(self, name), getattr(self, pre) if self.pre_norms else None,
                             getattr(self, post) if self.sandwich else None,
                             b=float(self.residual_scale))
        return (part(self.has_mixer, "mixer", "input_layernorm", "post_mixer_norm"),
                part(self.has_mlp, "mlp", "post_attention_layernorm", "post_mlp_norm"))

    def _residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y * self.residual_scale if self.residual_scale != 1.0 else x + y

    def forward(self, x: torch.Tensor, entries: dict[str, Any], lengths: torch.Tensor,
                one_token: bool = False, new: torch.Tensor | None = None) -> torch.Tensor:
        if self.has_mixer:
            h = self.input_layernorm(x)
            if not self.stateful:
                h = self.mixer(h)
            elif one_token:
                h = self.mixer.step(h, entries, lengths)
            else:
                h = self.mixer(h, entries, lengths, new)
            x = self._residual(x, self.post_mixer_norm(h) if self.sandwich else h)
        if self.has_mlp:
            h = self.mlp(self.post_attention_layernorm(x))
            x = self._residual(x, self.post_mlp_norm(h) if self.sandwich else h)
        return x
