"""Hugging Face checkpoint folders: finding them, reading their config, weights, tokenizer and
chat template, and serving the text model they hold behind
:class:`linserve.model.interface.ServedModel`.

A folder holds ``config.json``, ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), ``tokenizer.json``, and optionally ``tokenizer_config.json``,
``chat_template.jinja`` and ``generation_config.json``. A repo id is resolved through
``huggingface_hub``: downloaded when online, read from its cache offline (``HF_HUB_OFFLINE``).
Every problem is a :class:`CheckpointError` with a one-line message.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from linserve.model import heap, modes, packing
from linserve.model.architectures import rwkv_pth
from linserve.model.fingerprint import files_fingerprint
from linserve.model.gguf.checkpoint import GGUFCheckpoint
from linserve.model.gguf.checkpoint import checkpoint as gguf_checkpoint
from linserve.model.gguf.files import GGUFFileError, is_gguf
from linserve.model.gguf.mmproj import MMProj, is_mmproj, mmproj
from linserve.model.interface import CheckpointError
from linserve.model.layers import moe
from linserve.model.tokenizer import TextTokenizer, Tokenizer
from linserve.model.world_tokenizer import (
    WORLD_CHAT_TEMPLATE,
    WORLD_VOCAB,
    VocabFileError,
    WorldTokenizer,
)

log = logging.getLogger("linserve")


def gguf(path: Path) -> GGUFCheckpoint:
    """The GGUF model at ``path``; any problem with it is a one-line CheckpointError."""
    try:
        return gguf_checkpoint(path)
    except GGUFFileError as exc:
        raise CheckpointError(str(exc)) from None


def mmproj_file(path: Path) -> MMProj:
    """The mmproj file at ``path``; any problem with it is a one-line CheckpointError."""
    try:
        return mmproj(path)
    except GGUFFileError as exc:
        raise CheckpointError(str(exc)) from None


def config_json(path: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (for a GGUF file, the one its metadata stands for,
    :mod:`linserve.model.gguf.archs`)."""
    if is_gguf(path):
        return dict(gguf(path).config)
    if rwkv_pth.is_pth(path):
        return rwkv_pth.config(path)
    return read_json(path / "config.json")


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object from ``path`` ({} when optional and absent)."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: missing")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def parse_config(path: Path, parse: Callable[[dict[str, Any]], Any]) -> Any:
    """``parse`` of the folder's ``config.json``; a missing or inconsistent field (KeyError,
    TypeError, ValueError naming it), or a variant not served (NotImplementedError), is a
    one-line :class:`CheckpointError`."""
    try:
        return parse(config_json(path))
    except NotImplementedError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        where = path if is_gguf(path) or rwkv_pth.is_pth(path) else f"{path}/config.json"
        raise CheckpointError(f"{where}: inconsistent or incomplete "
                              f"({type(exc).__name__}: {exc})") from None


def tensor_files(path: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint and the file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        files = {name: path / str(f) for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{path}: shard {f.name} is missing")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path}: neither model.safetensors nor an index of shards")
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


# A part of a checkpoint tensor (None: all of it): indices, slices or a tensor of indices,
# one per leading dimension (defined beside the stacked experts' split, which the layers
# cannot import from here).
Index = moe.Part
Wanted = dict[str, tuple[Path, str, Index]]  # parameter -> (file, tensor name, part)
# A checkpoint tensor (its renamed name and shape) that fills several parameters, each with
# a part of it; None: not such a tensor.
Split = Callable[[str, tuple[int, ...]], list[tuple[str, Index]] | None]


CheckT = TypeVar("CheckT", bound=Callable[[Any, Path, torch.dtype], None])
_CHECKED: set[tuple[str, Path, torch.dtype, tuple[tuple[str, int, int], ...]]] = set()


def checked_once(check: CheckT) -> CheckT:
    """A family's ``check(self, path, dtype)`` run once a process for each checkpoint as its
    files are now (their names, sizes and times): the server checks before it starts and
    the load checks again (the match of a 0.8B model's tensor names and its tokenizer took
    0.3 s of every start). A check that fails runs again, and raises again."""

    @functools.wraps(check)
    def run(family: Any, path: Path, dtype: torch.dtype) -> None:
        key = (type(family).__qualname__, path, dtype, _files_now(path))
        if key not in _CHECKED:
            check(family, path, dtype)
            _CHECKED.add(key)

    return run  # type: ignore[return-value]


def _files_now(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, modification time) of the checkpoint file ``path`` or of each file in
    the folder ``path`` (nothing where it cannot be read)."""
    try:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        return tuple((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files)
    except OSError:
        return ()


def plan(module: nn.Module, path: Path, rename: Callable[[str], str | None],
         split: Split = moe.split_stacked) -> tuple[Wanted, list[str]]:
    """Which checkpoint tensor fills each of ``module``'s parameters (``rename`` maps a
    checkpoint name to the module's; None: not ours), read from the safetensors headers
    alone: every parameter present, with its shape. A tensor that is no parameter may fill
    several with its parts (``split``; by default a tensor that stacks every expert of a
    layer, :func:`moe.split_stacked`). Returns {parameter: (file, name, part)} and the
    checkpoint names left unused."""
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    files, shapes = _tensors(path, rename, split, ours)
    wanted: Wanted = {}
    unused = []
    for name, file in files.items():
        target = rename(name)
        pieces: list[tuple[str, Index]] = [] if target is None else \
            [(target, None)] if target in ours else list(split(target, shapes[name]) or [])
        if not pieces or any(t not in ours for t, _ in pieces):
            unused.append(name)
            continue
        for t, index in pieces:
            wanted[t] = (file, name, index)
            shape = shapes[name] if index is None else _part_shape(shapes[name], index)
            if shape != ours[t]:
                raise CheckpointError(f"{path}: tensor {name} has shape {shapes[name]}, the "
                                      f"config implies {ours[t]}"
                                      + ("" if index is None else " for each part"))
    missing = sorted(set(ours) - set(wanted))
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]} is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return wanted, unused


def _tensors(path: Path, rename: Callable[[str], str | None], split: Split,
             ours: dict[str, tuple[int, ...]]
             ) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Every tensor name of the checkpoint, the file holding it, and its shape. A GGUF
    file's tensors are named as the Hugging Face checkpoint named them, where ``rename``
    takes that name to one of ``ours`` (or ``split`` to parts of several); a tensor the
    converter squeezed or flattened takes the shape of ours (:func:`read_into` reshapes)."""
    if rwkv_pth.is_pth(path):
        found = rwkv_pth.sources(path)
        return {n: path for n in found}, {n: s.shape for n, s in found.items()}
    if not is_gguf(path):
        files = tensor_files(path)
        return files, _shapes(files)

    def accept(name: str, shape: tuple[int, ...]) -> bool:
        target = rename(name)
        if target is None:
            return False
        if target in ours:
            return _numel(shape) == _numel(ours[target])
        parts = [t for t, _ in split(target, shape) or []]
        return bool(parts) and all(t in ours for t in parts)

    ck = gguf(path)
    shapes = {}
    for name in ck.names(accept):
        target = rename(name)
        shapes[name] = ours[target] if target in ours else ck.shape(name)
    files = {n: path for n in shapes}
    tower = modes.mmproj()
    if tower is not None and any(k.startswith("visual.") for k in ours):
        proj = mmproj_file(tower)  # a vision tower beside it (llama.cpp's --mmproj)
        for name in proj.names:
            files[name], shapes[name] = tower, proj.shape(name)
    return files, shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def checkpoint_params(path: Path) -> int:
    """Parameters stored in the checkpoint at ``path`` (from its safetensors headers)."""
    if is_gguf(path):
        return gguf(path).params()
    if rwkv_pth.is_pth(path):
        return sum(_numel(s.shape) for s in rwkv_pth.sources(path).values())
    total = 0
    for shape in _shapes(tensor_files(path)).values():
        n = 1
        for size in shape:
            n *= size
        total += n
    return total


def _part_shape(shape: tuple[int, ...], index: tuple[int | slice | torch.Tensor, ...]
                ) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape``."""
    out: list[int] = []
    for n, i in zip(shape, index, strict=False):
        if isinstance(i, slice):
            out.append(len(range(*i.indices(n))))
        elif isinstance(i, torch.Tensor):
            out.append(len(i))
    return (*out, *shape[len(index):])


def tensor_shape(path: Path, name: str) -> tuple[int, ...] | None:
    """The shape of one tensor of a safetensors checkpoint, from its header (None: absent)."""
    file = tensor_files(path).get(name)
    if file is None:
        return None
    with safe_open(str(file), "pt") as f:
        return tuple(f.get_slice(name).get_shape())


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _by_file(wanted: Wanted) -> dict[Path, list[tuple[str, str, Index]]]:
    """{parameter: (file, name, part)} regrouped as {file: [(parameter, name, part)]}, so
    each shard is opened once."""
    groups: dict[Path, list[tuple[str, str, Index]]] = {}
    for target, (file, name, index) in wanted.items():
        groups.setdefault(file, []).append((target, name, index))
    return groups


def load_weights(module: nn.Module, path: Path, rename: Callable[[str], str | None],
                 dtype: torch.dtype, packer: LayerPacker | None = None,
                 split: Split = moe.split_stacked) -> list[str]:
    """Fill ``module``'s parameters from the checkpoint (see :func:`plan`), then cast them to
    ``dtype``. Returns the checkpoint names left unused.

    With a ``packer`` (a served model, inside :func:`packing.packing_once`), everything
    outside ``linserve.model.layers`` is read first and the head packed, then each layer is read and
    packed in turn, each original freed as it is packed: loading never holds the checkpoint
    whole beside its packed copy. The heap is trimmed each time the resident set has grown
    ``TRIM_DURING_LOAD``: glibc would otherwise keep those frees resident until the end. A
    progress bar on stderr counts the layers (vLLM shows its checkpoint shards the same
    way)."""
    wanted, unused = plan(module, path, rename, split)
    groups: dict[int, Wanted] = {}
    for target, where in wanted.items():
        hit = _LAYER.match(target) if packer is not None else None
        groups.setdefault(int(hit.group(1)) if hit else -1, {})[target] = where
    order = sorted(groups)
    trim = heap.Trimmer(TRIM_DURING_LOAD)
    progress = tqdm(order, desc=f"Loading {path.name}", unit="layer", file=sys.stderr,
                    disable=packer is None, mininterval=0.5)
    for index in progress:
        ours = module.state_dict()  # not held across packing: it would keep the originals
        for file, pairs in _by_file(groups[index]).items():
            read_into(file, [(ours[target], name, part) for target, name, part in pairs])
        del ours
        if packer is not None:
            packer.pack_head() if index < 0 else packer.pack_layer(index)
            trim()
    packing.fill_values()  # a weight given as blocks that nothing packed: its values
    cast(module, dtype)
    return unused


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def materialise(module: ModuleT) -> ModuleT:
    """``module.to_empty(device="cpu")``: a meta module's tensors allocated on the CPU,
    uninitialised, each with its size, strides and dtype. Through ``torch.empty_strided``:
    ``to_empty``'s ``empty_like`` took PyTorch's Python reference path for every tensor (0.66 s
    of the 0.8B shapes' load for 320 tensors, against 0.01 s)."""
    return module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                                       device="cpu"))


def cast(module: ModuleT, dtype: torch.dtype) -> ModuleT:
    """``module.to(dtype)``, except for the floating tensors of a submodule that sets
    ``fp32_weights`` (a router): those stay or become fp32, as llama.cpp keeps
    ``ffn_gate_inp``. A bf16 router moves near-ties between experts, and a token then reads
    other experts than the fp32 model's."""
    for m in module.modules():
        want = torch.float32 if getattr(m, "fp32_weights", False) else dtype
        for tensors in (m._parameters, m._buffers):
            for t in tensors.values():
                if t is not None and t.is_floating_point() and t.dtype != want:
                    t.data = t.data.to(want)
    return module


# Growth of the resident set past which a load trims the heap between layers (model.heap).
TRIM_DURING_LOAD = 256 << 20
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LayerPacker(Protocol):
    """A module that packs its head, and each layer alone (:class:`DecoderLM`)."""

    def pack_head(self) -> None: ...

    def pack_layer(self, i: int) -> None: ...


# safetensors' dtype names, for the ones read directly (others go through safe_open)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_into(file: Path, pairs: list[tuple[torch.Tensor, str, Index]]) -> None:
    """Copy each named tensor of the safetensors ``file`` (or the given part of it) into its
    destination, by plain reads: a whole tensor of the destination's dtype lands in it
    directly, another is read once into a buffer of its own size, then cast or split among
    its destinations. ``safe_open`` maps the whole file, and every page it has touched
    counts as resident while it is open: loading a 1.5 GB checkpoint showed 3.3 GB at its
    peak, against 1.8 GB this way."""
    by_name: dict[str, list[tuple[torch.Tensor, Index]]] = {}
    for dest, name, index in pairs:
        by_name.setdefault(name, []).append((dest, index))
    if rwkv_pth.is_pth(file):
        for name, dests in by_name.items():
            _scatter(rwkv_pth.read(file, name), dests)
        return
    if is_mmproj(file):
        for name, dests in by_name.items():
            _scatter(mmproj_file(file).read(name), dests)
        return
    if is_gguf(file):
        ck = gguf(file)
        for name, dests in by_name.items():
            whole = dests[0][0]
            blocks = (ck.native_blocks(name) if packing.native_blocks() and len(dests) == 1
                      and dests[0][1] is None and len(whole.shape) == 2 else None)
            if blocks is not None and blocks.shape == tuple(whole.shape):
                # packed from its blocks: no dequantized copy is written
                packing.give_blocks(whole, blocks, values=functools.partial(ck.read, name))
                continue
            t = ck.read(name)
            if dests[0][1] is None and t.shape != whole.shape and t.numel() == whole.numel():
                t = t.reshape(whole.shape)  # squeezed or flattened by the converter
            _scatter(t, dests)
        return
    with file.open("rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        start = 8 + size
        odd = []
        for name, dests in by_name.items():
            info = header[name]
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                odd.append(name)
                continue
            begin, end = info["data_offsets"]
            fh.seek(start + begin)
            first = dests[0][0]
            direct = len(dests) == 1 and dests[0][1] is None and first.dtype == dtype \
                and first.is_contiguous()
            buf = first if direct else torch.empty(info["shape"], dtype=dtype)
            view: Any = buf.view(-1).view(torch.uint8).numpy()  # a writable buffer
            if fh.readinto(view) != end - begin:
                raise CheckpointError(f"{file}: {name} is cut short")
            if not direct:
                _scatter(buf, dests)
    if odd:
        with safe_open(str(file), "pt") as f:
            for name in odd:
                _scatter(f.get_tensor(name), by_name[name])


def _scatter(t: torch.Tensor, dests: list[tuple[torch.Tensor, Index]]) -> None:
    for dest, index in dests:
        dest.copy_(t if index is None else t[index])


def fingerprint(path: Path) -> str:
    """config.json and the weight files, sampled (:mod:`linserve.model.fingerprint`)."""
    if is_gguf(path):
        tower = modes.mmproj() if modes.images_wanted() else None
        return gguf(path).fingerprint() + ("" if tower is None else
                                           "-v" + mmproj_file(tower).fingerprint()[:16])
    pth = rwkv_pth.pth_file(path)
    if pth is not None:
        return files_fingerprint([pth], b"")
    return files_fingerprint(sorted(set(tensor_files(path).values())),
                             (path / "config.json").read_bytes())


def load_tokenizer(path: Path, config: dict[str, Any], vocab_size: int) -> TextTokenizer:
    """``tokenizer.json`` with the end-of-sequence ids of ``generation_config.json`` (else
    the config's; for a GGUF file, its own vocabulary)."""
    if is_gguf(path):
        return gguf(path).tokenizer(vocab_size)
    file = (path.parent if path.is_file() else path) / "tokenizer.json"  # (beside a .pth)
    if not file.is_file():
        world = world_vocab(path)
        if world is not None:
            return world
        raise CheckpointError(f"{path}: tokenizer.json is missing")
    gen = read_json(path / "generation_config.json", required=False)
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
    try:
        tok = Tokenizer.from_file(file, eos_ids or None, vocab_size)
    except Exception as exc:  # tokenizers raises its own exception types
        raise CheckpointError(f"{file}: cannot be read ({exc})") from None
    if tok.vocab_size > vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tok.vocab_size} tokens, the model "
                              f"{vocab_size}")
    return tok


def world_vocab(path: Path) -> WorldTokenizer | None:
    """RWKV's world vocabulary where the checkpoint is one (a ``.pth``, or a folder with
    ``rwkv_vocab_*.txt``): the file beside it, else the one the package ships (a ``.pth``
    alone); None for any other checkpoint."""
    found = world_vocab_file(path)
    if found is None and not rwkv_pth.is_pth(path):
        return None
    size = int(config_json(path)["vocab_size"])
    try:
        world = WorldTokenizer.from_file(found or WORLD_VOCAB, size)
    except (OSError, VocabFileError) as exc:
        raise CheckpointError(str(exc)) from None
    if world.vocab_size > size:  # (an RWKV-4 "pile" model's 50,277 tokens, say)
        raise CheckpointError(f"{path}: the model has {size} tokens, RWKV's world vocabulary "
                              f"{world.vocab_size}: put the checkpoint's own tokenizer.json "
                              "beside it")
    return world


def world_vocab_file(path: Path) -> Path | None:
    """An ``rwkv_vocab_*.txt`` in the checkpoint's folder (None: none there)."""
    found = sorted((path.parent if path.is_file() else path).glob("rwkv_vocab_*.txt"))
    return found[0] if found else None


def chat_template(path: Path) -> str | None:
    """``chat_template.jinja``, else the ``chat_template`` of ``tokenizer_config.json`` (a
    GGUF file's ``tokenizer.chat_template``)."""
    if is_gguf(path):
        return gguf(path).chat_template()
    if rwkv_pth.is_pth(path):
        return WORLD_CHAT_TEMPLATE
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = read_json(path / "tokenizer_config.json", required=False).get("chat_template")
    if isinstance(template, str):
        return template
    return WORLD_CHAT_TEMPLATE if world_vocab_file(path) is not None else None
