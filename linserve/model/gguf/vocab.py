"""A GGUF file's ``tokenizer.ggml.*`` metadata as a ``tokenizers`` tokenizer.

Two vocabulary kinds are served, as llama.cpp names them in ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE. The merges are the file's; the pre-tokenizer is the sequence of
  split expressions llama.cpp's ``llama-vocab.cpp`` uses for ``tokenizer.ggml.pre``
  (:data:`PRE_SPLITS`), each isolating its matches, then GPT-2's byte-to-unicode table.
- ``llama``: SentencePiece BPE (Llama-2, Phi-3, Mistral): spaces become ``▁``, one is put in
  front (``tokenizer.ggml.add_space_prefix``), and pieces merge by their scores, the
  higher first; characters outside the vocabulary fall back to ``<0xNN>`` byte tokens.

Control tokens (type 3) are special added tokens; user-defined ones (type 4) are added tokens
that print as their text. BOS / EOS are put around a prompt where ``add_bos_token`` /
``add_eos_token`` say so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token types (llama_token_type): the ones that become added tokens.
CONTROL, USER_DEFINED, UNKNOWN, BYTE = 3, 4, 2, 6

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# deepseek-llm's letters, as llama-vocab.cpp lists them (escaped: they include look-alikes
# of ASCII letters, such as U+212A KELVIN SIGN, that an editor would normalise away)
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_STARCODER = [r"\p{N}", _GPT2]
# tokenizer.ggml.pre -> the split expressions llama-vocab.cpp applies in turn (its
# llm_tokenizer_bpe), and whether merges are skipped for whole words in the vocabulary.
PRE_SPLITS: dict[str, tuple[list[str], bool]] = {
    **{p: ([_LLAMA3], True) for p in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                      "falcon-h1", "pixtral", "midm-2.0", "lfm2")},
    **{p: ([_LLAMA3], False) for p in ("dbrx", "smaug-bpe", "chatglm-bpe")},
    **{p: ([_QWEN2], False) for p in ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan")},
    "qwen35": ([_QWEN35], False),
    **{p: ([_GPT2], False) for p in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe",
                                     "granite-docling", "trillion", "mellum", "modern-bert")},
    **{p: (_STARCODER, False) for p in ("starcoder", "refact", "command-r", "smollm",
                                        "codeshell", "exaone", "minerva-7b")},
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+",
                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                "[0-9][0-9][0-9]"], False),
    "deepseek-llm": (["[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", _DEEPSEEK_PUNCT, r"\s+$",
                      _CJK, r"\p{N}+"], False),
    "deepseek-coder": (["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"], False),
}


class VocabError(ValueError):
    """The file's vocabulary is of a kind not served (the message names it)."""


def tokenizer_json(meta: dict[str, Any]) -> dict[str, Any]:
    """A ``tokenizer.json`` (as a dict) for the vocabulary in ``meta`` (the GGUF metadata,
    key -> value). Raises :class:`VocabError` for a kind or pre-tokenizer not served."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        body = _byte_level_bpe(meta)
    elif kind == "llama":
        body = _sentencepiece_bpe(meta)
    else:
        raise VocabError(f"tokenizer.ggml.model {kind!r} is not served (gpt2 and llama are)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind_ == CONTROL}
             for i, (t, kind_) in enumerate(zip(tokens, types, strict=True))
             if kind_ in (CONTROL, USER_DEFINED)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            **body, "post_processor": _bos_eos(meta, tokens)}


def build(meta: dict[str, Any]) -> HFTokenizer:
    """The ``tokenizers`` tokenizer of :func:`tokenizer_json`."""
    return HFTokenizer.from_str(json.dumps(tokenizer_json(meta), ensure_ascii=False))


def _byte_level_bpe(meta: dict[str, Any]) -> dict[str, Any]:
    pre = str(meta.get("tokenizer.ggml.pre") or "gpt-2")
    if pre == "default":
        pre = "gpt-2"
    if pre not in PRE_SPLITS:
        raise VocabError(f"tokenizer.ggml.pre {pre!r} is not served (one of "
                         f"{', '.join(sorted(PRE_SPLITS))})")
    splits, ignore_merges = PRE_SPLITS[pre]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [m.split(" ", 1) for m in meta.get("tokenizer.ggml.merges") or []]
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
               "invert": False} for r in splits), byte_level]},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}


def _sentencepiece_bpe(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None else next(
        (t for t, k in zip(tokens, types, strict=True) if k == UNKNOWN), None)
    normal = [i for i, k in enumerate(types) if k not in (CONTROL, USER_DEFINED, UNKNOWN, BYTE)]
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    return {
        "normalizer": {"type": "Sequence", "normalizers": [
            *([{"type": "Prepend", "prepend": "▁"}] if prefix else []),
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk_token,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": _score_merges(tokens, scores, normal)}}


def _score_merges(tokens: Sequence[str], scores: Sequence[float], normal: Sequence[int]
                  ) -> list[list[str]]:
    """SentencePiece BPE's merges, as ranks: every split of a normal piece into two pieces of
    the vocabulary, the piece of higher score first (SentencePiece merges the pair whose
    result scores highest); among one piece's splits, the one with the longer left part
    first."""
    ids = {tokens[i]: i for i in normal}
    found: list[tuple[float, int, int, str, str]] = []
    for i in normal:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [[left, right] for _, _, _, left, right in found]


def _bos_eos(meta: dict[str, Any], tokens: Sequence[str]) -> dict[str, Any] | None:
    """A template post-processor putting BOS / EOS around a prompt where the metadata asks."""
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    ends = []
    for key, default in (("bos", default_bos), ("eos", False)):
        want = meta.get(f"tokenizer.ggml.add_{key}_token", default)
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        ends.append((tokens[int(tid)], int(tid)) if want and tid is not None else None)
    if ends == [None, None]:
        return None
    bos, eos = ends
    single: list[dict[str, Any]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    if bos:
        single.insert(0, {"SpecialToken": {"id": bos[0], "type_id": 0}})
    if eos:
        single.append({"SpecialToken": {"id": eos[0], "type_id": 0}})
    specials = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in (e for e in ends if e)}
    return {"type": "TemplateProcessing", "single": single, "pair": [
        *single, {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": specials}
