"""Test data from the llama.cpp that the ``llama-cpp-python==0.3.36`` sdist vendors whole.

The sdist comes from PyPI (the one registry CI reaches) on first use and only the files the
tests need are kept, under ``$LINSERVE_TEST_CACHE`` (default ``~/.cache/linserve-test``):

- ``models/ggml-vocab-qwen35.gguf``: a Qwen-family byte-level BPE (151,936 ids) with the
  Qwen3.5 pre-tokenizer, and its ``.inp`` / ``.out`` test vectors;
- ``models/templates/*.jinja``: real chat templates (Qwen3.5, Qwen3-Coder, Hermes, LFM2,
  Granite-4.0, Nemotron-Nano-v2, Kimi-K2, Ling 3.0, MiniMax-M1).

:func:`qwen_tokenizer_json` turns the GGUF vocabulary into a Hugging Face ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

VERSION = "0.3.36"
VENDORED = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
WANTED = (
    "models/ggml-vocab-qwen35.gguf",
    "models/ggml-vocab-qwen35.gguf.inp",
    "models/ggml-vocab-qwen35.gguf.out",
    "models/templates/Qwen3.5-4B.jinja",
    "models/templates/Qwen3-Coder.jinja",
    "models/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "models/templates/LFM2.5-Instruct.jinja",
    "models/templates/LFM2-8B-A1B.jinja",
    "models/templates/ibm-granite-granite-4.0.jinja",
    "models/templates/NVIDIA-Nemotron-Nano-v2.jinja",
    "models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "models/templates/Qwen-Qwen3-0.6B.jinja",
    "models/templates/moonshotai-Kimi-K2.jinja",
    "models/templates/Kimi-K2-Instruct.jinja",
    "models/templates/inclusionai-ling-3.0-flash.jinja",
    "models/templates/MiniMax-M1.jinja",
    # the BPE and SentencePiece vocabularies with test vectors (the GGUF tokenizer's tests)
    *(f"models/ggml-vocab-{name}.gguf{ext}" for name in (
        "qwen2", "gpt-2", "llama-bpe", "command-r", "deepseek-coder", "deepseek-llm",
        "falcon", "mpt", "refact", "starcoder", "llama-spm", "phi-3")
      for ext in ("", ".inp", ".out")),
)
# llama.cpp's converter, whole: the GGUF tests convert tiny checkpoints with it (it runs on
# its own gguf-py, put first on PYTHONPATH; nothing of llama.cpp is built).
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")

# The pre-tokenizer regex of Qwen3.5's tokenizer.json, as llama.cpp's llama-vocab.cpp quotes it.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The GGUF keeps placeholders ([PAD151646]…) where Qwen3 checkpoints publish these added tokens;
# they are put back at their published ids so chat templates, tool calls and thinking tokenize
# as they do for real checkpoints. ``True`` marks a special (control) token.
QWEN3_ADDED = {
    151646: ("<|object_ref_start|>", True), 151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True), 151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True), 151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True), 151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True), 151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True), 151657: ("<tool_call>", False),
    151658: ("</tool_call>", False), 151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False), 151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False), 151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False), 151665: ("<tool_response>", False),
    151666: ("</tool_response>", False), 151667: ("<think>", False),
    151668: ("</think>", False),
}


def cache_dir() -> Path:
    """The folder the vendored files are kept in."""
    root = os.environ.get("LINSERVE_TEST_CACHE") or Path.home() / ".cache" / "linserve-test"
    return Path(root) / f"llamacpp-{VERSION}"


def vendored(relpath: str) -> Path:
    """Path of one of :data:`WANTED`, fetching the sdist from PyPI the first time."""
    path = cache_dir() / relpath
    if not path.exists():
        _fetch()
    return path


def converter() -> Path:
    """The folder holding llama.cpp's ``convert_hf_to_gguf.py``, its ``conversion/`` package
    and ``gguf-py/``, fetching the sdist the first time."""
    root = cache_dir() / "converter"
    if not (root / ".complete").exists():
        _fetch(trees=CONVERTER, into=root)
        (root / ".complete").write_text(VERSION)
    return root


def _fetch(trees: tuple[str, ...] = (), into: Path | None = None) -> None:
    """Download the sdist and keep only :data:`WANTED` (an atomic rename per file), or with
    ``trees``, every file under those prefixes, into ``into``."""
    dest = cache_dir()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp],
                       check=True)
        with tarfile.open(Path(tmp) / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            if trees and into is not None:
                members = [m for m in tar.getmembers() if m.isfile()
                           and m.name.startswith(VENDORED)
                           and m.name[len(VENDORED):].startswith(trees)]
                for m in members:
                    m.name = m.name[len(VENDORED):]
                tar.extractall(into, members=members, filter="data")
                return
            for rel in WANTED:
                member = tar.extractfile(VENDORED + rel)
                assert member is not None, rel
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                part = out.with_suffix(out.suffix + ".part")
                part.write_bytes(member.read())
                part.replace(out)


def qwen_tokenizer_json(gguf_path: Path) -> dict[str, Any]:
    """A ``tokenizer.json`` (as a dict) equivalent to the GGUF's BPE vocabulary.

    Tokens of GGUF type 1 form the BPE vocabulary with the GGUF's merges; control tokens (type
    3) become special added tokens; placeholders become :data:`QWEN3_ADDED` where listed.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    merges = [m.split(" ", 1) for m in fields["tokenizer.ggml.merges"].contents()]
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == 1}
    added = []
    for i, (t, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == 1:
            continue
        content, special = QWEN3_ADDED.get(i, (t, kind == 3))
        vocab[content] = i
        added.append({"id": i, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": special})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,  # the test vectors keep decomposed accents as they come
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_SPLIT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False,
                           "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


QWEN_VOCAB = 151_936
QWEN_TEMPLATE = "models/templates/Qwen3.5-4B.jinja"
# <|im_end|> ends a chat turn and <|endoftext|> a document, as in Qwen3.5's generation config
QWEN_EOS = [151645, 151643]


def write_qwen_tokenizer_files(path: Path) -> None:
    """The tokenizer files of a published Qwen3.5 instruct checkpoint, into ``path``:
    ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` (Qwen3.5's own) and
    ``generation_config.json`` (its end-of-sequence ids)."""
    write_qwen_tokenizer(path)
    shutil.copy(vendored(QWEN_TEMPLATE), path / "chat_template.jinja")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 262144}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN_EOS}))


def write_qwen_tokenizer(folder: Path) -> Path:
    """Write ``tokenizer.json`` for the vendored Qwen vocabulary into ``folder``."""
    built = cache_dir() / "qwen35-tokenizer.json"
    if not built.exists():
        part = built.with_suffix(".part")
        part.write_text(json.dumps(qwen_tokenizer_json(vendored(WANTED[0])), ensure_ascii=False))
        part.replace(built)
    out = folder / "tokenizer.json"
    shutil.copyfile(built, out)
    return out
