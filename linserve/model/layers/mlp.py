"""Feed-forward blocks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from linserve.model import invariant, kernels, packing
from linserve.model.invariant import Linear

# the gate's activations a gated MLP takes, by the names configs give them
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``; gate and up run as one GEMM. ``[..., d] -> [..., d]``.
    ``fused``: gate and up stored as one ``gate_up_proj`` weight ``[2f, d]``, gate first
    (Granite's ``input_linear``); else ``gate_proj`` and ``up_proj``. ``multipliers``:
    Falcon-H1's, on the gate's input to the activation and on the output. ``act``: another
    gate activation of :data:`ACTIVATIONS` (GeGLU: Zamba2's ``gelu``, Gemma's tanh form)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, fused: bool = False,
                 multipliers: tuple[float, float] = (1.0, 1.0), act: str = "silu") -> None:
        super().__init__()
        self.multipliers = multipliers
        self.act = act
        self._act = ACTIVATIONS[act]
        if fused:
            self.gate_up_proj = Linear(dim, 2 * hidden, bias=bias)
        else:
            self.gate_proj = Linear(dim, hidden, bias=bias)
            self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)
        self.fused = fused

    def _parts(self) -> list[Linear]:
        return [self.gate_up_proj] if self.fused else [self.gate_proj, self.up_proj]

    def gate_up(self) -> torch.Tensor:
        """gate and up as one GEMM weight ``[d, 2f]`` (:func:`packing.gemm_weight`)."""
        return packing.gemm_weight(self, *(p.weight for p in self._parts()))

    def native_weights(self) -> list[torch.Tensor] | None:
        """(gate_up ``[d, 2f]``, down ``[f, d]``) GEMM weights as the native kernels take
        them; None for a form they lack (biases, multipliers)."""
        if (self.multipliers != (1.0, 1.0) or self.act != "silu"
                or any(p.bias is not None for p in self._parts())):
            return None
        return [self.gate_up(), packing.packed(self.down_proj)]

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``delta [..., 2f]`` is added to gate and up before the activation (Zamba2's
        adapter)."""
        gate_up = invariant.project(x, self.gate_up())
        if delta is not None:
            gate_up = gate_up + delta.to(gate_up.dtype)
        biases: list[torch.Tensor] = [p.bias for p in self._parts() if p.bias is not None]
        if self._native_activation(gate_up, biases):
            act = torch.ops.linserve.swiglu_rows(gate_up.reshape(-1, gate_up.shape[-1]))
            return self.down_proj(act.view(*x.shape[:-1], -1)).to(x.dtype)
        gate_up = gate_up.to(x.dtype)
        if biases:
            gate_up = gate_up + torch.cat(biases)
        gate, up = gate_up.chunk(2, dim=-1)
        gate_m, out_m = self.multipliers
        if gate_m != 1.0:
            gate = gate * gate_m
        # contiguous: ATen vectorises a strided view differently as the rows' count varies
        out = self.down_proj(invariant.rowwise(self._act, gate.contiguous()) * up)
        return out * out_m if out_m != 1.0 else out

    def _native_activation(self, gate_up: torch.Tensor, biases: list[torch.Tensor]) -> bool:
        """Whether the activation runs natively (``swiglu_rows``), in fp32 between the two
        GEMMs as the native steps compute it: an fp32 ``gate_up`` (the invariant GEMM's),
        inference, and no biases or multipliers."""
        return (gate_up.dtype == torch.float32 and not biases and self.act == "silu"
                and self.multipliers == (1.0, 1.0) and kernels.available()
                and not torch.is_grad_enabled())


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: ``down(relu(up(x))²)``. ``[..., d] -> [..., d]``. Nemotron-H's MLP
    blocks are ``x + mlp(norm(x))``, it in the mixer's place (``decoder.Block``)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)

    def native_weights(self) -> list[torch.Tensor] | None:
        """(up ``[d, f]``, down ``[f, d]``) GEMM weights as the native kernels take them;
        None with biases, which they lack."""
        if self.up_proj.bias is not None or self.down_proj.bias is not None:
            return None
        return [packing.packed(self.up_proj), packing.packed(self.down_proj)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(invariant.rowwise(torch.relu, self.up_proj(x)).square())
