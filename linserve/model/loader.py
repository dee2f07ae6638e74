"""Loading a checkpoint folder or GGUF file as a :class:`linserve.model.interface.ServedModel`.

The families and what recognises their checkpoints are :mod:`linserve.model.architectures.
registry`'s; the server calls :func:`load`, :func:`check` and :func:`max_state_bytes` and
never imports a family itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from linserve.model import checkpoint_path, kernels, memory, modes, packing
from linserve.model.architectures import hf, registry, rwkv_pth
from linserve.model.architectures.registry import CheckpointLoader, Family
from linserve.model.gguf.files import is_gguf
from linserve.model.interface import CheckpointError, ServedModel, StateError
from linserve.model.kernels import cpu_flags

log = logging.getLogger("linserve")
# CPU flags (as /proc/cpuinfo names them) of native bf16 dot products: AVX512-BF16's
# vdpbf16ps and AMX's tile products. Without them oneDNN emulates bf16 through fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Bytes a parameter takes as served under each quantization (int8: one fp32 scale per output
# column, counted as nothing; int4: 4 bits and an fp16 scale per 32); None: the dtype's size.
QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5625}


def family(path: Path) -> Family:
    """The family whose checkpoints look like ``path``."""
    if not (is_gguf(path) or rwkv_pth.is_pth(path) or (path / "config.json").is_file()):
        raise CheckpointError(f"{path}: no config.json (not a checkpoint folder)")
    config = hf.config_json(path)
    found = registry.recognise(config)
    if found is None:
        raise CheckpointError(f"{path}: unknown architecture (model_type "
                              f"{config.get('model_type')!r}; this server loads its own "
                              f"checkpoints and {', '.join(registry.known_model_types())})")
    return found


def family_loader(path: Path) -> CheckpointLoader:
    """What checks and loads the checkpoint at ``path`` (its family's ``FAMILY``)."""
    return family(path).loader()


def resolve(path_or_id: str | Path) -> Path:
    """A checkpoint folder, or a Hugging Face repo id through the local cache / the Hub."""
    return checkpoint_path.resolve(path_or_id)


def pick_dtype(requested: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """The weight dtype to load (``float32`` or ``bfloat16``) and why, for the startup log
    and ``/health``. ``auto`` is bf16 exactly where the CPU has native bf16 products."""
    if requested != "auto":
        return requested, f"--dtype {requested} was set"
    have = [f for f in BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return "bfloat16", f"auto: the CPU has native bf16 dot products ({', '.join(have)})"
    return "float32", "auto: the CPU has neither AVX512-BF16 nor AMX, so bf16 would be emulated"


def load(path: Path, dtype: str = "auto", fused: bool = True,
         batch_invariant: bool = True, quantization: str = "none",
         weights: bool = True, kv_cache_dtype: str = "auto") -> ServedModel:
    """Load the checkpoint at ``path`` with weights in ``dtype`` (see :func:`pick_dtype`),
    the native fused step where the architecture has one, batch-invariant kernels
    (:mod:`linserve.model.invariant`) unless turned off, and GEMM weights quantized to
    ``quantization`` (:mod:`linserve.model.quantize`). ``weights=False``: the model described
    without reading its weights (config, tokenizer, template, fingerprint, states and their
    codec; it cannot run, and ``info.weight_bytes`` is 0): what the HTTP process needs
    beside an engine process. ``kv_cache_dtype``: what attention caches hold
    (:func:`kv_dtype_for`)."""
    fam = family(path)
    if weights:  # described only, nothing runs: the kernels are not built for it
        kernels.load()  # the invariant GEMM and the native sampler serve every architecture
        if quantization != "none" and not kernels.available():
            raise CheckpointError(f"--quantization {quantization} needs the native kernels, "
                                  f"which did not load ({kernels.load_error()})")
        modes.set_enabled(batch_invariant)
    modes.set_quantization(quantization)
    # a GGUF file's Q4_0 matrices stay in their blocks unless --dtype asks for floats
    packing.set_native_blocks(is_gguf(path) and dtype == "auto" and quantization == "none")
    modes.set_kv_cache_dtype(kv_dtype_for(kv_cache_dtype, path, quantization))
    if is_gguf(path) and weights:
        log.info("%s: %s", path.name, hf.gguf(path).load_plan(pick_dtype(dtype)[0],
                                                              packing.native_blocks()))
    try:
        served = fam.loader().load(path, getattr(torch, pick_dtype(dtype)[0]), fused, weights)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    tuned = rwkv_pth.time_states(path) if rwkv_pth.is_pth(path) else {}
    if tuned:  # a state-tuned .pth merged into its weights starts every sequence from it
        try:
            served.set_initial_tensors(tuned)
        except StateError as exc:
            raise CheckpointError(f"{path}: its time_state tensors: {exc}") from None
    return served


def kv_dtype_for(asked: str, path: Path, quantization: str) -> str:
    """``--kv-cache-dtype``: ``fp32``, ``bf16`` or ``int8`` as asked; ``auto`` is bf16 where
    the weights are quantized (a GGUF file's quantized types, ``--quantization``), whose
    rounding is far coarser than bf16's, and fp32 otherwise (exact against transformers)."""
    if asked != "auto":
        return asked
    quantized = quantization != "none" or (is_gguf(path) and hf.gguf(path).quantized())
    return "bf16" if quantized else "fp32"


def check(path: Path, dtype: str = "auto", quantization: str = "none", budget: int = 0
          ) -> None:
    """Check the checkpoint at ``path`` as far as possible without loading its weights (the
    server does this before it starts, so a bad checkpoint is one line, not a traceback):
    that its weights, as served, fit the memory available and the ``budget``
    (``--max-memory``; 0: none), then the family's own checks (config, tensors, tokenizer).
    """
    check_memory(path, dtype, quantization, budget)
    family_loader(path).check(path, getattr(torch, pick_dtype(dtype)[0]))


def check_memory(path: Path, dtype: str = "auto", quantization: str = "none",
                 budget: int = 0) -> None:
    """:func:`check`'s first part alone: that the weights, as served, fit the memory
    available and the ``budget`` (0: none). What an early load checks before it loads
    (the load checks the rest itself, quietly)."""
    dt = getattr(torch, pick_dtype(dtype)[0])
    need = weight_bytes(family_loader(path).params(path), dt, quantization)
    served = quantization if quantization != "none" else str(dt).removeprefix("torch.")
    if is_gguf(path):
        ck = hf.gguf(path)
        ck.check_types()
        if quantization != "none" and ck.quantized():
            raise CheckpointError(f"{path}: its weights are quantized already "
                                  f"({ck.describe_types()}); --quantization {quantization} "
                                  f"would quantize them twice (leave it out)")
        need = ck.served_bytes(dt, native=dtype == "auto" and quantization == "none")
        served = f"{ck.describe_types()} ({served} where dequantized)"
    have = available_memory()
    if need > 0.9 * have:
        raise CheckpointError(f"{path}: the weights need {need / 2**30:.1f} GiB as {served}, "
                              f"{have / 2**30:.1f} GiB is available")
    if budget and need > budget:
        raise CheckpointError(f"{path}: the weights need {need / 2**30:.1f} GiB as {served}, "
                              f"more than --max-memory ({budget / 2**30:.1f} GiB)")


def weight_bytes(params: int, dtype: torch.dtype, quantization: str = "none") -> int:
    """The bytes ``params`` parameters take as served (an estimate before loading)."""
    per = QUANTIZED_BYTES.get(quantization) or torch.empty(0, dtype=dtype).element_size()
    return int(params * per)


def max_state_bytes(path: Path) -> int:
    """The largest one-session state the checkpoint at ``path`` can have, without loading
    its weights (the bound on an imported blob)."""
    return family_loader(path).max_state_bytes(path)


def available_memory() -> int:
    """Bytes this process may still use: the cgroup limit, else MemAvailable."""
    return memory.available_memory()


def batch_invariant_active() -> bool:
    """Whether batch-invariant kernels are running in this process."""
    return modes.active()
