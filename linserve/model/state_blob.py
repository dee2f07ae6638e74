"""Session blobs: a :class:`~linserve.model.state.State` as safetensors bytes, and back, validated.

Format 3 (this one) names every tensor ``"{layer}.{entry}.{tensor}"`` plus ``"lengths"``,
and records the per-layer layout, the format version and the fingerprint of the model that
made it in the header. Formats 1 and 2 (one stacked ``s``/``z``/``conv`` for linear models, or
``k``/``v``/``lengths`` ``[B, L, ...]`` for KV caches) still import: they are split into the
same per-layer entries and then checked like any format-3 blob. Nothing is unpickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from linserve.model.blob_view import read_header
from linserve.model.info import STATE_FORMAT_VERSION
from linserve.model.state import (
    KV_DTYPES,
    ConvEntry,
    KVEntry,
    RecurrentEntry,
    State,
    StateError,
)

READABLE_FORMAT_VERSIONS = ("1", "2", "3")


def state_to_bytes(state: State, fingerprint: str, extra: dict[str, Any] | None = None) -> bytes:
    """Serialise with the format version, layout and model fingerprint in the header."""
    meta = {"format_version": str(STATE_FORMAT_VERSION), "fingerprint": fingerprint,
            "layout": json.dumps(state.layout()), "extra": json.dumps(extra or {})}
    return st_save({k: v.contiguous() for k, v in state.tensors().items()}, metadata=meta)


def state_from_bytes(data: bytes, template: State, fingerprint: str
                     ) -> tuple[State, dict[str, Any]]:
    """Parse and validate a blob against ``template`` (the model's one-row empty state);
    returns (state, extra). Raises :class:`StateError` for another model's state, a wrong
    layout, shape or dtype, or anything that is not a well-formed safetensors blob."""
    meta = read_header(data)[0].get("__metadata__") or {}
    version = meta.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise StateError(f"unsupported state format version {version!r} "
                         f"(this server reads {', '.join(READABLE_FORMAT_VERSIONS)})")
    if meta.get("fingerprint") != fingerprint:
        raise StateError("state was made by a different model (fingerprint mismatch)")
    try:
        tensors = st_load(data)
        extra = json.loads(meta.get("extra", "{}"))
        extra = extra if isinstance(extra, dict) else {}
        if version == "3":
            layout = json.loads(meta.get("layout", "null"))
        else:
            tensors, layout = _upgrade(meta, tensors, template, extra)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        if isinstance(exc, StateError):
            raise
        raise StateError(f"state blob is corrupt: {exc}") from exc
    layout = _kv_dtypes_filled(layout)
    held = _template_like(template, layout)
    if layout != held.layout():
        raise StateError("state layout does not match this model's layers")
    return _build(tensors, held).as_kv_dtypes(template), extra


def _kv_dtypes_filled(layout: Any) -> Any:
    """A blob's layout with ``"dtype": "fp32"`` on KV entries written before caches had a
    dtype (``--kv-cache-dtype``)."""
    if isinstance(layout, list):
        for spec in layout:
            for desc in spec.values() if isinstance(spec, dict) else ():
                if isinstance(desc, dict) and desc.get("kind") == "kv":
                    desc.setdefault("dtype", "fp32")
    return layout


def _template_like(template: State, layout: Any) -> State:
    """``template`` with its KV caches in the dtypes ``layout`` gives them (a blob written by
    a server with another ``--kv-cache-dtype``: read as it is, then converted)."""
    if not isinstance(layout, list) or len(layout) != len(template.layers):
        return template
    layers = []
    for spec, layer in zip(layout, template.layers, strict=True):
        out = dict(layer)
        for name, e in layer.items():
            desc = spec.get(name) if isinstance(spec, dict) else None
            dtype = desc.get("dtype") if isinstance(desc, dict) else None
            if isinstance(e, KVEntry) and dtype in KV_DTYPES and dtype != e.dtype:
                out[name] = e.as_dtype(dtype)
        layers.append(out)
    return State(layers, template.lengths)


def _upgrade(meta: dict[str, str], tensors: dict[str, torch.Tensor], template: State,
             extra: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """A format-1/2 blob's stacked tensors split into the template's per-layer names."""
    kind = meta.get("kind")
    expected = "softmax" if any(isinstance(e, KVEntry) for e in template.entries()) \
        else "linear"
    if kind != expected:
        raise StateError(f"state kind {kind!r} does not match model ({expected})")
    window = next((e.window for e in template.entries() if isinstance(e, KVEntry)), 0)
    if kind == "softmax" and meta.get("window", "0") != str(window):
        raise StateError(f"state is a KV cache for window {meta.get('window', '0')!r}; "
                         f"this model's window is {window}")
    if set(tensors) != ({"k", "v", "lengths"} if kind == "softmax" else {"s", "z", "conv"}):
        raise StateError("state blob has unexpected tensors")
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(template.layers):
        for name, e in layer.items():
            pick = {RecurrentEntry: {"s": ("s", 0), "z": ("z", 0)}, ConvEntry: {
                "window": ("conv", 0)}, KVEntry: {"k": ("k", 1), "v": ("v", 1)}}[type(e)]
            for t, (old, dim) in pick.items():
                if old not in tensors or tensors[old].dim() < 2 \
                        or tensors[old].shape[dim] != len(template.layers):
                    raise StateError(f"state tensor {old} has the wrong shape")
                out[f"{i}.{name}.{t}"] = tensors[old].select(dim, i)
    if kind == "softmax":
        out["lengths"] = tensors["lengths"]
    else:  # linear blobs did not count tokens: the session's count, less what is pending
        rows = tensors["s"].shape[1]
        held = int(extra.get("tokens", 0) or 0) - len(extra.get("pending", []) or [])
        out["lengths"] = torch.full((rows,), max(held, 0), dtype=torch.long)
    return out, template.layout()


def _build(tensors: dict[str, torch.Tensor], template: State) -> State:
    """Check every tensor's name, dtype, shape and values against the template."""
    lengths = tensors.get("lengths")
    if lengths is None or lengths.dtype != torch.long or lengths.dim() != 1:
        raise StateError("state tensor lengths is missing or not int64 [B]")
    rows = lengths.shape[0]
    if rows < 1 or int(lengths.min()) < 0:
        raise StateError("state lengths are out of range")
    ref = template.tensors()
    if set(tensors) != set(ref):
        raise StateError("state blob has missing or unexpected tensors")
    state = State.from_tensors(template.layout(), tensors)
    for mine, theirs in zip(state.layers, template.layers, strict=True):
        for name, e in mine.items():
            _check_entry(name, e, theirs[name], state.lengths)
    return state


def _check_entry(name: str, e: Any, ref: Any, lengths: torch.Tensor) -> None:
    rows = lengths.shape[0]
    for t, x in e.tensors().items():
        want = (rows, *ref.tensors()[t].shape[1:])
        if isinstance(e, KVEntry):  # the slot dimension is the cache's own capacity
            want = (rows, want[1], x.shape[2] if x.dim() == 4 else -1, want[3])
        if x.dtype != e.dtype_of(t):
            raise StateError(f"state tensor {name}.{t} has dtype {x.dtype}, expected "
                             f"{e.dtype_of(t)}")
        if tuple(x.shape) != want:
            raise StateError(f"state tensor {name}.{t} has shape {tuple(x.shape)}, "
                             f"expected {want}")
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise StateError(f"state tensor {name}.{t} holds NaN or inf")
        if isinstance(e, KVEntry) and e.dtype == "int8" and not torch.isfinite(
                x[..., e.head_dim :].contiguous().view(torch.float32)).all():
            raise StateError(f"state tensor {name}.{t} holds NaN or inf scales")
    if isinstance(e, KVEntry):
        if e.capacity > e.slot_limit:
            raise StateError(f"KV cache capacity {e.capacity} exceeds the model's limit of "
                             f"{e.slot_limit} slots")
        if e.v.shape[:3] != e.k.shape[:3] or int(e.slots_used(lengths).max()) > e.capacity:
            raise StateError("KV cache lengths are out of range")
