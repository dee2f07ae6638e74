"""A GGUF model seen as the Hugging Face checkpoint it was converted from: its
``config.json``, its tensors under their Hugging Face names with their original values, its
tokenizer and chat template. :mod:`linserve.model.architectures.hf` reads a ``.gguf`` path
through this, so every family that llama.cpp writes loads from either form.

Tensor names: a GGUF name (``blk.3.attn_qkv.weight``) goes back to each Hugging Face name
gguf-py's map gives for it (:func:`archs.hf_candidates`), and the first one the loading
family accepts is taken. Values: a quantized tensor is dequantized by ``gguf.quants`` (the
reference implementation of every block format), then the architecture's inverse transform
applies (:mod:`linserve.model.gguf.archs`).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer as HFTokenizer

from linserve.model import kernels
from linserve.model.fingerprint import files_fingerprint
from linserve.model.gguf import archs, vocab, vocab_cache
from linserve.model.gguf.files import GGUFFileError, GGUFModel, Tensor, open_model, release_pages
from linserve.model.packing import Blocks
from linserve.model.quantize import PACKED_BYTES, stored_format
from linserve.model.tokenizer import TextTokenizer, Tokenizer
from linserve.model.world_tokenizer import WORLD_CHAT_TEMPLATE, WorldTokenizer

# The storage types served: the float ones, llama.cpp's legacy blocks and its K-quants.
SERVED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
          Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL)
FLOATS = (Q.F32, Q.F16, Q.BF16)
# Block formats whose matrices the quantized GEMM multiplies as they are, and the GEMM
# format each is packed in (linserve/model/kernels/gemm_quant.h's QFormat: 1 int4, 2 q8,
# 3 q4k, 4 q8k: W = s q + t per 32, nibbles or bytes, s and t one-byte multipliers of a
# super-block's pair; 5 q6: W = s q per 16, in six bits or bytes (quantize.stored_format);
# 6 q4l and 7 q8l: q4k and q8k with a super-block of one block).
NATIVE = {Q.Q4_0: 1, Q.Q8_0: 2, Q.Q4_K: 3, Q.Q4_1: 6, Q.Q5_K: 4, Q.Q5_0: 7, Q.Q5_1: 7,
          Q.Q6_K: 5}
# The formats the kernels pack straight from the file's blocks (gguf_blocks.h's pack_gguf);
# the others go through their values (block_values).
PACKED_RAW = (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Control tokens that end a generation in llama.cpp (its llama_vocab end-of-generation
# list), besides tokenizer.ggml.eos_token_id / eot_token_id / eom_token_id.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>",
                     "<|return|>", "<|call|>", "<|im_end|>")


class GGUFCheckpoint:
    """The model at ``path`` (any shard of it). Raises :class:`GGUFFileError` (one line) for
    an unreadable file, an architecture not served, or metadata that is missing a key."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model: GGUFModel = open_model(path)
        try:
            self.arch = archs.arch_of(self.model)
            self.config: dict[str, Any] = self.arch.config(self.model)
            self._candidates = archs.hf_candidates(archs.arch_enum(self.model),
                                                   int(self.model.require("block_count")))
        except KeyError as exc:
            raise GGUFFileError(f"{path}: {exc.args[0]}") from None
        # Hugging Face name -> the GGUF tensors it is read from (one, or the parts of a
        # merge), once accepted
        self._names: dict[str, tuple[str, ...]] = {}
        self._candidate_names: dict[str, list[str]] | None = None  # (_hf_names)
        self._orders: dict[tuple[str, int, int], torch.Tensor | bool] = {}  # (_row_order)
        # the vocabulary, read from the cache (or built) once asked for (_vocab)
        self._vocab_read: Future[HFTokenizer] | None = None
        self._vocab_lock = threading.Lock()
        self._wrapped: dict[int, TextTokenizer] = {}
        self._shapes: dict[tuple[str, ...], tuple[int, ...]] = {}  # _shape's answers

    def names(self, accept: Callable[[str, tuple[int, ...]], bool]) -> dict[str, str]:
        """Hugging Face name -> GGUF name for every tensor, taking for each the first
        Hugging Face name gguf-py maps to it that ``accept`` takes, with the shape it would
        have (a tensor none is accepted for keeps its GGUF name, and is reported unused)."""
        merged = self._merges()
        out: dict[str, tuple[str, ...]] = {}
        for gname, names in self._hf_names().items():
            chosen = next((n for n in names if accept(n, self._shape(n, gname))), gname)
            out[chosen] = (gname,)
        out.update(merged)
        self._names = out
        return {name: parts[0] for name, parts in out.items()}

    def _hf_names(self) -> dict[str, list[str]]:
        """GGUF name -> the Hugging Face names it may have, in order of preference, for
        every tensor that is not part of a merge (matched once: the check and the load
        each ask, and the regular expressions took 0.24 s a 0.8B model's match)."""
        if self._candidate_names is not None:
            return self._candidate_names
        taken = {part for parts in self._merges().values() for part in parts}
        patterns = [(re.compile(pattern), repl) for pattern, repl in self.arch.names]
        mtp = self._mtp_names()
        out: dict[str, list[str]] = {}
        for gname in self.model.tensors:
            if gname in taken:
                continue
            base, dot, suffix = gname.rpartition(".")
            if suffix not in ("weight", "bias"):  # a bare name, such as blk.0.ssm_a
                base, dot, suffix = gname, "", ""
            # each name with the suffix, then bare, where the converter added one (LFM2-MoE's
            # expert_bias buffer became exp_probs_b.bias)
            names = [p.sub(repl, gname) for p, repl in patterns if p.fullmatch(gname)]
            names += [mtp(self.arch.rename(n)) for cand in self._candidates.get(base, ())
                      for n in ((f"{cand}{dot}{suffix}", cand) if dot else (cand,))]
            nextn = _NEXTN_NAME.fullmatch(gname)
            if nextn and nextn.group(1) in _NEXTN:  # gguf-py maps them for some arches only
                names.insert(0, f"mtp.{_NEXTN[nextn.group(1)]}.{nextn.group(2)}")
            out[gname] = names
        self._candidate_names = out
        return out

    def _mtp_names(self) -> Callable[[str], str]:
        """A Hugging Face name of a block past the model's layers as its MTP name: llama.cpp
        writes MTP layer i as block ``n_layer + i`` (``nextn_predict_layers`` of them), and
        the MTP block's fc and norms as that block's ``nextn.*`` (:data:`_NEXTN`; Qwen's
        ``_QwenMtpMixin``)."""
        nextn = int(self.model.get("nextn_predict_layers", 0) or 0)
        first = int(self.model.require("block_count")) - nextn

        def rename(name: str) -> str:
            match = _LAYER_NAME.fullmatch(name) if nextn else None
            if match is None or int(match.group(1)) < first:
                return name
            return f"mtp.layers.{int(match.group(1)) - first}.{match.group(2)}"

        return rename

    def _merges(self) -> dict[str, tuple[str, ...]]:
        """Hugging Face name -> its parts, for every merge of the architecture whose parts
        are all in the file."""
        merged: dict[str, tuple[str, ...]] = {}
        blocks = int(self.model.require("block_count"))
        for rule in self.arch.merges(self.config):
            for n in range(blocks):
                parts = tuple(p.format(n=n) for p in rule.parts)
                into = rule.into.format(n=n)
                if into not in merged and all(p in self.model.tensors for p in parts):
                    merged[into] = parts
        return merged

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The tensor's shape as the Hugging Face checkpoint had it."""
        return self._shape(hf_name, *self._names.get(hf_name, (hf_name,)))

    def _shape(self, hf_name: str, *gguf_names: str) -> tuple[int, ...]:
        """(Remembered: the names are matched once by the check and once by the load, and
        each meta-tensor transform costs ~0.2 ms, 0.7 s a 0.8B model's match.)"""
        key = (hf_name, *gguf_names)
        if key not in self._shapes:
            shapes = [self.model.tensors[g].shape for g in gguf_names]
            probes = [_shape_probe(s, sum(int(np.prod(x)) for x in shapes)) for s in shapes]
            self._shapes[key] = tuple(
                self.arch.transform(hf_name, self._join(hf_name, probes), self.config).shape)
        return self._shapes[key]

    def read(self, hf_name: str) -> torch.Tensor:
        """The tensor as the Hugging Face checkpoint had it (fp32 where it was quantized)."""
        names = self._names.get(hf_name, (hf_name,))
        parts = [dequantize(self.model.tensors[g]) for g in names]
        for g in names:
            release_pages(self.model.tensors[g].raw)
        return self.arch.transform(hf_name, self._join(hf_name, parts), self.config)

    def _join(self, hf_name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else self._rule(hf_name).join(parts, self.config)

    def _rule(self, hf_name: str) -> archs.Merge:
        """The merge that makes ``hf_name``."""
        return next(r for r in self.arch.merges(self.config)
                    if re.fullmatch(r.into.replace(".", r"\.").format(n=r"\d+"), hf_name))

    def native_blocks(self, hf_name: str) -> Blocks | None:
        """A matrix ``[out, in]`` in one of the :data:`NATIVE` formats as the quantized
        GEMM's blocks: a K-quant's own rows of blocks where the kernels pack those directly
        (:data:`PACKED_RAW`), else q ``[out, in]`` int8 and its scales
        (:func:`block_values`): the same numbers, so it is repacked, not quantized again. A
        merge of parts
        stacked by rows (Granite's gate and up in one ``input_linear``) is its parts' blocks
        stacked, when they share a format. None for any other tensor, one the converter
        transformed, an untied embedding table (never a GEMM's: its rows are read from the
        dequantized table), or a Q8_0 block holding −128 (the AVX2 product takes each
        value's sign apart, and −128 has no positive twin; such a matrix is dequantized)."""
        if hf_name.endswith("embed_tokens.weight") and "output.weight" in self.model.tensors:
            return None
        names = self._names.get(hf_name, (hf_name,))
        parts = [self.model.tensors[g] for g in names]
        if (len({t.qtype for t in parts}) != 1 or parts[0].qtype not in NATIVE
                or any(len(t.shape) != 2 for t in parts) or not self._stacked(hf_name, names)):
            return None
        rows, cols = sum(t.shape[0] for t in parts), parts[0].shape[1]
        order = self._row_order(hf_name, rows, cols)
        if order is False:
            return None
        qtype = parts[0].qtype
        if qtype in PACKED_RAW and kernels.available():
            if qtype == Q.Q8_0 and any(_holds_minus_128(t) for t in parts):
                return None
            if len(parts) == 1 and order is True:  # packed from the mapped file itself
                return Blocks((rows, cols), NATIVE[qtype], raw=_mapped(parts[0]),
                              ggml_type=int(qtype), done=partial(release_pages, parts[0].raw))
            raw = _raw_rows(parts)
            if isinstance(order, torch.Tensor):  # rows moved: each row's blocks move with it
                raw = raw[order]
            return Blocks((rows, cols), NATIVE[qtype], raw=raw, ggml_type=int(qtype))
        values = [block_values(t) for t in parts]
        for t in parts:
            release_pages(t.raw)
        q, scales = (torch.cat([v[i] for v in values]) if len(values) > 1 else values[0][i]
                     for i in (0, 1))
        if qtype == Q.Q8_0 and bool((q == -128).any()):
            return None
        if isinstance(order, torch.Tensor):  # rows moved: each row's blocks move with it
            q, scales = q[order], scales[order]
        return Blocks((rows, cols), NATIVE[qtype], q=q, scales=scales)

    def _row_order(self, hf_name: str, rows: int, cols: int) -> torch.Tensor | bool:
        """How the converter's transform of ``hf_name`` (``[rows, cols]``) moved its rows:
        True if it left the tensor as it is, the source row of each row if it only reordered
        whole rows (Qwen3.5's value heads, tiled by the converter where a model has more
        value heads than key heads: the blocks lie along a row, so they move with it), False
        for any other change (values, or inputs moved across blocks)."""
        probe = _shape_probe((rows, cols), rows * cols)
        if self.arch.transform(hf_name, probe, self.config) is probe:
            return True
        key = (re.sub(r"\.\d+\.", ".N.", hf_name), rows, cols)  # every layer's the same
        if key not in self._orders:
            self._orders[key] = self._probe_rows(hf_name, rows, cols)
        return self._orders[key]

    def _probe_rows(self, hf_name: str, rows: int, cols: int) -> torch.Tensor | bool:
        """:meth:`_row_order` of a matrix the transform changes, from its row and column
        indices run through it."""
        if rows * cols > ROW_PROBE_ELEMENTS:
            return False
        index = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, cols)
        moved = self.arch.transform(hf_name, index, self.config)
        if moved.shape != (rows, cols) or not bool((moved == moved[:, :1]).all()):
            return False
        order = moved[:, 0].long()
        if not torch.equal(order.sort().values, torch.arange(rows)):
            return False
        columns = torch.arange(cols, dtype=torch.float32)[None, :].expand(rows, cols)
        if not torch.equal(self.arch.transform(hf_name, columns, self.config), columns):
            return False
        return order

    def _stacked(self, hf_name: str, names: tuple[str, ...]) -> bool:
        """Whether ``names`` make ``hf_name`` by stacking their rows (one name does)."""
        if len(names) == 1:
            return True
        rule = self._rule(hf_name)
        return rule.combine is None and rule.dim == 0

    def quantization_types(self) -> dict[str, int]:
        """Storage type name -> how many tensors have it."""
        counts: dict[str, int] = {}
        for t in self.model.tensors.values():
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
        return counts

    def check_types(self) -> None:
        """Raise :class:`GGUFFileError` naming a storage type that is not served."""
        for t in self.model.tensors.values():
            if t.qtype not in SERVED:
                raise GGUFFileError(f"{self.path}: tensor {t.name} is stored as "
                                    f"{t.qtype.name}, which is not served (these are: "
                                    f"{', '.join(q.name for q in SERVED)})")

    def quantized(self) -> bool:
        """Whether any tensor is stored in a block format."""
        return any(t.qtype not in FLOATS for t in self.model.tensors.values())

    def describe_types(self) -> str:
        """The storage formats and how many tensors have each, e.g. "Q4_K 98, Q6_K 13,
        F32 49"."""
        counts = sorted(self.quantization_types().items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {n}" for name, n in counts)

    def served_bytes(self, dtype: torch.dtype, native: bool) -> int:
        """The bytes the weights take as served: a :data:`NATIVE` matrix its packed blocks
        when ``native`` (it runs on them), every other tensor its values in ``dtype``."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(PACKED_BYTES[stored_format(NATIVE[t.qtype])] * int(np.prod(t.shape)) // 32
                   if native and t.qtype in NATIVE and len(t.shape) == 2
                   else int(np.prod(t.shape)) * size for t in self.model.tensors.values())

    def load_plan(self, dtype: str, native: bool) -> str:
        """One line for the startup log: the file's formats and what loading does with
        each (``native``: the :data:`NATIVE` formats kept in their blocks; otherwise every
        block format dequantized, as ``--dtype`` or ``--quantization`` asked)."""
        blocks = [q for q in self.quantization_types() if q not in ("F32", "F16", "BF16")]
        head = f"GGUF {self.arch.name}, {self.describe_types()}"
        if not blocks:
            return f"{head}: floats as {dtype}"
        if not native:
            return f"{head}: every block format dequantized to {dtype} at load, as asked"
        kept = [q for q in blocks if Q[q] in NATIVE]
        rest = [q for q in blocks if q not in kept]
        return (f"{head}: " + (f"{' and '.join(kept)} matrices run on their own blocks"
                               if kept else "")
                + ("; " if kept and rest else "")
                + (f"{', '.join(rest)} dequantized to {dtype} at load (no native product "
                   f"for them yet)" if rest else ""))

    def params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.model.tensors.values())

    def file_bytes(self) -> int:
        """The bytes of every tensor as stored."""
        return sum(t.nbytes for t in self.model.tensors.values())

    def tokenizer(self, vocab_size: int) -> TextTokenizer:
        """The file's vocabulary (:mod:`linserve.model.gguf.vocab`; RWKV's world vocabulary,
        :mod:`linserve.model.world_tokenizer`) with its end ids (made once). Where its byte
        table is kept (:mod:`.vocab_cache`: the vocabulary was built and read before), the
        ``tokenizers`` one is read when first needed (a 250k-token vocabulary's JSON holds
        the GIL for half a second: :class:`Tokenizer`); else it is built or read now, and
        checked."""
        meta = self.model.meta
        if vocab_size not in self._wrapped and meta.get("tokenizer.ggml.model") == "rwkv":
            self._wrapped[vocab_size] = WorldTokenizer.from_gguf(
                list(meta["tokenizer.ggml.tokens"]),
                list(meta.get("tokenizer.ggml.token_type") or []), vocab_size, self.end_ids())
        if vocab_size not in self._wrapped:
            files = self.model.files
            table = vocab_cache.load_bytes(files, meta)
            if table is not None:
                tok = Tokenizer(self._vocab, self.end_ids(), vocab_size, table,
                                source=vocab_cache.cache_file(files))
            else:
                hf_tok = self._vocab()
                tok = Tokenizer(hf_tok, self.end_ids(), vocab_size)
                vocab_cache.keep_bytes(files, meta, tok.token_bytes[:hf_tok.get_vocab_size()])
            self._wrapped[vocab_size] = tok
        return self._wrapped[vocab_size]

    def _vocab(self) -> HFTokenizer:
        """The ``tokenizers`` vocabulary (:func:`vocab_cache.load`, once: the first caller
        reads it, others wait). Raises :class:`GGUFFileError` for one that cannot be built."""
        with self._vocab_lock:
            first = self._vocab_read is None
            if self._vocab_read is None:
                self._vocab_read = Future()
        if first:
            try:
                self._vocab_read.set_result(vocab_cache.load(self.model.files, self.model.meta))
            except (vocab.VocabError, KeyError) as exc:
                self._vocab_read.set_exception(GGUFFileError(f"{self.path}: {exc}"))
        assert self._vocab_read is not None
        return self._vocab_read.result()

    def end_ids(self) -> list[int]:
        """The ids that end a generation: EOS, EOT and EOM, and the control tokens
        llama.cpp also treats as ends."""
        meta = self.model.meta
        ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
               if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
        tokens = meta.get("tokenizer.ggml.tokens") or []
        types = list(meta.get("tokenizer.ggml.token_type") or [])[:len(tokens)]
        ends = set(END_OF_GENERATION)  # (only the control tokens' names are read)
        ids += [i for i, k in enumerate(types) if k == vocab.CONTROL and tokens[i] in ends]
        return list(dict.fromkeys(ids))

    def chat_template(self) -> str | None:
        """The file's template; RWKV's chat format for an ``rwkv`` vocabulary whose
        converter wrote only its name (``rwkv-world``)."""
        template = self.model.meta.get("tokenizer.chat_template")
        if self.model.meta.get("tokenizer.ggml.model") == "rwkv" and (
                not isinstance(template, str) or "{" not in template):
            return WORLD_CHAT_TEMPLATE
        return template if isinstance(template, str) else None

    def fingerprint(self) -> str:
        """The files, sampled (:mod:`linserve.model.fingerprint`)."""
        return files_fingerprint(self.model.files)


# Elements up to which a shape is found on a zeroed CPU tensor rather than a meta one.
PROBE_ELEMENTS = 1 << 24
# Elements up to which a transformed matrix is probed for a reordering of its rows (two fp32
# index tensors of its shape, one at a time: a Qwen3.5-27B qkv, 52M, takes 210 MB for a
# moment, where serving it dequantized would keep 4x its blocks' size).
ROW_PROBE_ELEMENTS = 1 << 27


def _shape_probe(shape: tuple[int, ...], together: int) -> torch.Tensor:
    """A tensor of ``shape`` to run a transform on for the shape it gives: one zero on the
    CPU seen with that shape (stride 0, nothing allocated: views of it are free, and only an
    op's output is written) where the tensors merged with it have ``together`` elements at
    most, else a meta tensor. Arithmetic on a meta tensor runs through ``torch._refs``, whose
    first call imports ``torch._dynamo``: 1.5 s or more of every start, for norms' ``w - 1``
    and the like (and a zeroed tensor for each name, 3.2 s of a 0.8B file's start)."""
    if together <= PROBE_ELEMENTS:
        return torch.zeros(()).expand(shape)
    return torch.empty(shape, device="meta")


def dequantize(t: Tensor) -> torch.Tensor:
    """A tensor's values as fp32 ``t.shape`` (a float type as stored, widened). The
    :data:`NATIVE` formats from their unpacked blocks in PyTorch, with gguf-py's arithmetic
    (fp32 scale × value, + t), many times faster; every other block format by gguf-py's
    dequantizer."""
    if t.qtype in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.raw, dtype=np.float32).reshape(t.shape))
    if t.qtype == Q.BF16:
        raw = np.asarray(t.raw).view(np.int16)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
    if t.qtype in NATIVE:
        return from_blocks(*block_values(t), NATIVE[t.qtype]).reshape(t.shape)
    values = quants.dequantize(np.asarray(t.raw), t.qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(t.shape))


def from_blocks(q: torch.Tensor, scales: torch.Tensor, fmt: int) -> torch.Tensor:
    """:func:`block_values`' q ``[rows, cols]`` and scales back to the values, fp32 ``[rows,
    cols]``: q d per 32 (formats 1, 2), q s + t per 32 with s = m_s d, t = m_t e (3, 4, 6,
    7), q s_h per 16 with s_h = m_h d (5). Each product m d is exact, as gguf-py's."""
    rows, cols = q.shape
    if fmt in (1, 2):
        return (scales.float()[..., None] * q.view(rows, cols // 32, 32).float()).view(rows, cols)
    if fmt == 5:
        halves = scales[..., 0:2] * scales[..., 2:3]
        return (q.view(rows, cols // 32, 2, 16).float() * halves[..., None]).view(rows, cols)
    s, t = scales[..., 0:1] * scales[..., 2:3], scales[..., 1:2] * scales[..., 3:4]
    return (q.view(rows, cols // 32, 32).float() * s + t).view(rows, cols)


def q4_0_values(t: Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0's blocks ``[rows, blocks × 18]`` (an fp16 scale d, then 16 bytes: element j in
    the low nibble of byte j, element j + 16 in its high nibble; value d (nibble − 8)) ->
    q ``[rows, cols]`` int8 in [−8, 7] and d ``[rows, cols / 32]`` fp16."""
    rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]
    blocks = torch.from_numpy(np.asarray(t.raw).reshape(rows, cols // 32, 18).copy())
    scales = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, cols // 32)
    qs = blocks[..., 2:].to(torch.int16)
    q = torch.cat([qs & 0xF, qs >> 4], -1).sub_(8).to(torch.int8).reshape(rows, cols)
    return q, scales


def q8_0_values(t: Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's blocks (an fp16 scale d, then 32 int8 values q; value d q) -> q ``[rows,
    cols]`` int8 and d ``[rows, cols / 32]`` fp16, rows the product of every dimension but
    the last."""
    rows = int(np.prod(t.shape[:-1]))
    blocks = torch.from_numpy(np.asarray(t.raw).reshape(rows, -1, 34).copy())
    scales = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, -1)
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), scales


def _holds_minus_128(t: Tensor) -> bool:
    """Whether a Q8_0 matrix has a value of −128 (byte 0x80 after a block's fp16 scale)."""
    return bool(torch.ops.linserve.q8_0_holds_minus_128(_mapped(t)))


def _mapped(t: Tensor) -> torch.Tensor:
    """A block tensor's rows ``[rows, row bytes]`` uint8 where the file is mapped (read
    only: the kernels only read them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of a read-only array
        return torch.from_numpy(np.asarray(t.raw))


def _raw_rows(parts: list[Tensor]) -> torch.Tensor:
    """The parts' rows of blocks ``[Σ rows, row bytes]`` uint8, stacked, in memory of their
    own (the mapped file's pages are released: the packed weight is what stays)."""
    raw = torch.from_numpy(np.concatenate([np.asarray(t.raw) for t in parts]))
    for t in parts:
        release_pages(t.raw)
    return raw


def block_values(t: Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A :data:`NATIVE` matrix ``[rows, cols]``'s values as the GEMM format takes them: q
    ``[rows, cols]`` int8 and, for Q4_0 and Q8_0, their fp16 scales ``[rows, cols / 32]``
    (W = d q); for the others ``[rows, cols / 32, 4]`` fp32 (m_s, m_t, d, e) with W = s q +
    t per 32, s = m_s d and t = m_t e (Q4_K, Q4_1: q in [0, 15]; Q5_K, Q5_1: [0, 31]; Q5_0:
    [−16, 15]; d and e the same across a K-quant's super-block of 256, the legacy blocks'
    multipliers 1), or Q6_K's (m_lo, m_hi, d, 0) with W = m_h d q for each half of 16 (q in
    [−32, 31]); exactly gguf-py's dequantized values (each product is exact in fp32)."""
    if t.qtype == Q.Q4_0:
        return q4_0_values(t)
    if t.qtype == Q.Q8_0:
        return q8_0_values(t)
    rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]
    raw = np.asarray(t.raw).reshape(rows, -1)
    q, ms, mt, d, e = _K_UNPACK[t.qtype](raw.reshape(-1, GGML_QUANT_SIZES[t.qtype][1]))
    st = np.stack(np.broadcast_arrays(ms.astype(np.float32), mt.astype(np.float32), d, e), -1)
    return q.reshape(rows, cols), torch.from_numpy(st.reshape(rows, cols // 32, 4))


def _fp16(b: np.ndarray) -> np.ndarray:
    """Two bytes a block [n, 2] -> fp32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> torch.Tensor:
    """Bytes [n, k · group / 2] -> values [n, k · group] uint8: each run of ``group / 2``
    bytes gives its low nibbles, then its high ones (llama.cpp's order). In PyTorch, whose
    elementwise ops use every thread (numpy's took 1.8 s of a 0.8B Q4_K_M file's load)."""
    b = torch.from_numpy(np.ascontiguousarray(qs)).view(len(qs), -1, group // 2)
    return torch.stack((b & 15, b >> 4), dim=2).view(len(qs), -1)


def _bits(b: np.ndarray, width: int, shifts: int) -> torch.Tensor:
    """Bytes [n, runs × 32] -> each byte's ``shifts`` fields of ``width`` bits, low first,
    [n, runs × shifts × 32] uint8 (Q5_K's high bits, Q6_K's two high bits)."""
    t = torch.from_numpy(np.ascontiguousarray(b)).view(len(b), -1, 1, 32)
    step = torch.arange(0, width * shifts, width, dtype=torch.uint8).view(1, 1, shifts, 1)
    return ((t >> step) & ((1 << width) - 1)).view(len(b), -1)


# An unpacker's blocks: q [n, unit] int8, the multipliers m_s and m_t of each 32 [n, unit / 32]
# and the unit's d and e [n, 1] fp32 (unit: 256 for the K-quants, 32 for the legacy blocks).
Unpacked = tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _q4_k(b: np.ndarray) -> Unpacked:
    """Q4_K's blocks of 256 -> q [n, 256] int8 in [0, 15]; W = sc d q − mn dmin."""
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = quants.Q4_K.get_scale_min(b[:, 4:16])
    return _nibbles(b[:, 16:], 64).view(torch.int8), sc, mn, d, -dmin


def _q5_k(b: np.ndarray) -> Unpacked:
    """Q5_K's blocks of 256 -> q [n, 256] int8 in [0, 31]; W = sc d q − mn dmin."""
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = quants.Q4_K.get_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 48:], 64) | (_bits(b[:, 16:48], 1, 8) << 4)
    return q.view(torch.int8), sc, mn, d, -dmin


def _q6_k(b: np.ndarray) -> Unpacked:
    """Q6_K's blocks of 256 -> q [n, 256] int8 in [−32, 31], the int8 scales of the first
    and second 16 of each 32 [n, 8] each, and d; W = sc d q."""
    if kernels.available():  # one native pass (the layout is in q6_k_values), no copy
        with warnings.catch_warnings():  # a read-only map: the op only reads it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(np.ascontiguousarray(b))
        q = torch.ops.linserve.q6_k_values(blocks)
    else:
        q = (_nibbles(b[:, :128], 128) | (_bits(b[:, 128:192], 2, 4) << 4)).view(torch.int8) - 32
    sc = b[:, 192:208].view(np.int8)
    d = _fp16(b[:, 208:210])
    return q, sc[:, 0::2], sc[:, 1::2], d, np.zeros_like(d)


def _q_legacy(b: np.ndarray, with_min: bool, five: bool) -> Unpacked:
    """Q4_1 / Q5_0 / Q5_1's blocks of 32 -> q [n, 32] int8, multipliers 1, d and the min."""
    d = _fp16(b[:, 0:2])
    t = _fp16(b[:, 2:4]) if with_min else np.full_like(d, -0.0)  # x + (-0) is x, signed zeros too
    at = 4 if with_min else 2
    q = _nibbles(b[:, at + 4 * five:], 32).view(torch.int8)
    if five:
        bits = np.ascontiguousarray(b[:, at:at + 4]).view(np.uint32)
        high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int8)
        q = q | (torch.from_numpy(high) << 4)
        if not with_min:
            q = q - 16
    one = np.ones_like(d)
    return q, one, one, d, t


_K_UNPACK = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
             Q.Q4_1: lambda b: _q_legacy(b, True, False),
             Q.Q5_0: lambda b: _q_legacy(b, False, True),
             Q.Q5_1: lambda b: _q_legacy(b, True, True)}


# The MTP block's own tensors: llama.cpp's name (blk.N.nextn.*) -> the Hugging Face one
# (under mtp.), as _QwenMtpMixin renames them.
_NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
          "shared_head_norm": "norm"}
_NEXTN_NAME = re.compile(r"blk\.\d+\.nextn\.(\w+)\.(weight|bias)")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@lru_cache(maxsize=4)
def checkpoint(path: Path) -> GGUFCheckpoint:
    """The (cached) :class:`GGUFCheckpoint` of ``path``."""
    return GGUFCheckpoint(path)
