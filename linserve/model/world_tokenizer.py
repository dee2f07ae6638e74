"""The RWKV "world" vocabulary (``rwkv_vocab_v20230424.txt``, 65,529 byte strings): text is
UTF-8 bytes, cut by greedy longest match from the left, as BlinkDL's ``TRIE_TOKENIZER`` and
llama.cpp's ``rwkv`` vocabulary do. Id 0 is the end of text (no bytes).

The file's lines are ``<id> <a Python str or bytes literal> <its length in bytes>``, read with
:func:`ast.literal_eval` (a literal, never code). The package ships the vocabulary
(``linserve/model/vocab/``, from the ``rwkv`` package, Apache-2.0) for a ``.pth`` checkpoint
with none beside it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from linserve.model.tokenizer import BYTE_CHARS, TextTokenizer

WORLD_VOCAB = Path(__file__).parent / "vocab" / "rwkv_vocab_v20230424.txt"
END_OF_TEXT = "<|endoftext|>"
# RWKV's chat format: "Role: text" turns, a blank line after each (a blank line inside a text
# becomes one newline, as RWKV's own front ends write it), then "Assistant:".
WORLD_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set text = (m.content if m.content is string else '') "
    "| replace('\n\n', '\n') | trim -%}"
    "{{ (m.role | capitalize) ~ ': ' ~ text ~ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}Assistant:{% endif -%}")


class VocabFileError(ValueError):
    """A line of a vocabulary file that is not ``<id> <literal> <length>``."""


def read_vocab(path: Path) -> list[bytes]:
    """Each id's bytes (id 0: the end of text, empty) from a world vocabulary file."""
    table: dict[int, bytes] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            first, last = line.index(" "), line.rindex(" ")
            value = ast.literal_eval(line[first + 1 : last])
            token = value.encode("utf-8") if isinstance(value, str) else value
            if not isinstance(token, bytes) or len(token) != int(line[last + 1 :]):
                raise ValueError("its length does not match")
            table[int(line[:first])] = token
        except (ValueError, SyntaxError) as exc:
            raise VocabFileError(f"{path}:{n}: not '<id> <literal> <length>' ({exc})") from None
    size = max(table, default=0) + 1
    return [table.get(i, b"") for i in range(size)]


_ESCAPES = {"t": 9, "n": 10, "r": 13, "\\": 92, "'": 39, '"': 34}


def unescape_gguf_token(text: str) -> bytes:
    """A token of a GGUF ``rwkv`` vocabulary (llama.cpp's converter writes each as the
    inside of its Python bytes literal: ``\\xff``, ``\\n``, ``\\'``) back to its bytes, as
    llama.cpp's ``llama_unescape_rwkv_token`` reads it."""
    out = bytearray()
    raw = text.encode("utf-8")
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == 92 and i + 1 < len(raw):  # a backslash
            nxt = chr(raw[i + 1])
            if nxt == "x" and i + 3 < len(raw):
                out.append(int(raw[i + 2 : i + 4], 16))
                i += 4
                continue
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
        out.append(ch)
        i += 1
    return bytes(out)


class WorldTokenizer(TextTokenizer):
    """Greedy longest-match over bytes (see the module docstring). ``size``: the model's
    vocabulary (ids past the file decode to nothing); ``eos_ids``: the ids that end a
    generation (id 0, the end of text, by default; a GGUF file adds its end-of-turn)."""

    def __init__(self, token_bytes: list[bytes], size: int | None = None,
                 eos_ids: tuple[int, ...] = (0,)) -> None:
        self.vocab_size = max(size or 0, len(token_bytes))
        self.token_bytes = token_bytes + [b""] * (self.vocab_size - len(token_bytes))
        self.eos_ids = eos_ids
        self.eos_id = eos_ids[0]
        self._ids = {t: i for i, t in enumerate(token_bytes) if t}
        # per leading byte pair, the lengths of the tokens that start with it, longest first
        lengths: dict[bytes, set[int]] = {}
        for t in self._ids:
            lengths.setdefault(t[:2], set()).add(len(t))
        self._lengths = {k: sorted(v, reverse=True) for k, v in lengths.items()}

    @classmethod
    def from_file(cls, path: Path = WORLD_VOCAB, size: int | None = None) -> WorldTokenizer:
        return cls(read_vocab(path), size)

    @classmethod
    def from_gguf(cls, tokens: list[str], types: list[int], size: int,
                  eos_ids: list[int]) -> WorldTokenizer:
        """A GGUF ``rwkv`` vocabulary: id 0 (``<s>``) the end of text, the padding ids
        (type UNUSED) empty, the others unescaped (:func:`unescape_gguf_token`)."""
        unused = 5
        table = [b"" if i == 0 or (i < len(types) and types[i] == unused)
                 else unescape_gguf_token(t) for i, t in enumerate(tokens)]
        return cls(table, size, tuple(dict.fromkeys([0, *eos_ids])))

    def encode_bytes(self, data: bytes) -> list[int]:
        out: list[int] = []
        i, n = 0, len(data)
        ids, lengths = self._ids, self._lengths
        while i < n:
            for length in lengths.get(data[i : i + 2], ()):
                token = ids.get(data[i : i + length]) if i + length <= n else None
                if token is not None:
                    break
            else:  # no token of two or more bytes starts here: the single byte's
                length, token = 1, ids[data[i : i + 1]]
            out.append(token)
            i += length
        return out

    def encode(self, text: str) -> list[int]:
        return self.encode_bytes(text.encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        if token_id == 0:
            return END_OF_TEXT
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def special_tokens(self) -> list[str]:
        return []

    def token_id(self, text: str) -> int | None:
        if text == END_OF_TEXT:
            return 0
        return self._ids.get(text.encode("utf-8"))

    def to_json(self) -> str:
        """A byte-level ``tokenizers`` vocabulary with the same ids and bytes (what the
        grammar engine reads the tokens' bytes from; its merges are none)."""
        vocab = {"".join(BYTE_CHARS[b] for b in t): i for i, t in enumerate(self.token_bytes)
                 if t}
        added = [{"id": 0, "content": END_OF_TEXT, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True}]
        return json.dumps({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": False, "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": {END_OF_TEXT: 0, **vocab}, "merges": []}})
