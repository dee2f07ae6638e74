"""Tokenizer round trips and the incremental detokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from linserve.model.tokenizer import TextTokenizer, Tokenizer, train_tokenizer
from tests.paths import ROOT

TEXTS = ["Héllo wörld — naïve café", "日本語のテキストです。漢字", "emoji 🎭🗡️👑 and 👨‍👩‍👧 family",
         "plain ASCII, as Shakespeare wrote: To be, or not to be."]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("tok") / "corpus.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 50 + "café naïve\n")
    return Tokenizer(train_tokenizer([path], vocab_size=300))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_emits_partial_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 4  # multi-byte chars span several tokens
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_eos_token_exists(tok: Tokenizer) -> None:
    assert tok.eos_id is not None
    assert tok.decode([tok.eos_id]) == ""


def test_piece_bytes_translate_as_the_byte_table_does() -> None:
    """A byte-level piece's bytes through str.translate equal the table read a character at a
    time, for every character below 600 alone and in random pieces (those outside the table,
    such as SentencePiece's ▁, are byte 0 either way)."""
    import random

    from linserve.model import tokenizer

    def slow(piece: str) -> bytes:
        return bytes(tokenizer._DECODER.get(ch, 0) for ch in piece)

    chars = [chr(i) for i in range(600)] + ["▁", "Ġ", "Ċ"]
    rng = random.Random(0)
    pieces = chars + ["".join(rng.choices(chars, k=rng.randint(1, 8))) for _ in range(5000)]
    assert all(tokenizer._piece_bytes(p) == slow(p) for p in pieces)


def test_a_tokenizer_read_later_decodes_before_and_encodes_after(tok: Tokenizer) -> None:
    """A tokenizer given as a function with its byte table and end ids decodes and knows its
    size without reading it; its first encode reads it (once), as a prefetch does in a
    thread; what the function raises, every encode raises."""
    import threading

    from linserve.model.tokenizer import byte_table

    calls: list[int] = []
    hf = tok._tok

    def read() -> object:
        calls.append(1)
        return hf

    lazy = Tokenizer(read, tok.eos_ids, None, byte_table(hf))  # type: ignore[arg-type]
    ids = tok.encode(TEXTS[0])
    assert lazy.decode(ids) == TEXTS[0] and lazy.vocab_size == tok.vocab_size
    assert calls == []
    assert lazy.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and calls == [1]
    lazy.encode(TEXTS[2])
    assert calls == [1]

    prefetched = Tokenizer(read, tok.eos_ids, None, byte_table(hf))  # type: ignore[arg-type]
    prefetched.prefetch()
    [t.join() for t in threading.enumerate() if t.name == "tokenizer-read"]
    assert calls == [1, 1] and prefetched.encode(TEXTS[3]) == tok.encode(TEXTS[3])

    def broken() -> object:
        raise ValueError("no vocabulary")

    bad = Tokenizer(broken, tok.eos_ids, None, byte_table(hf))  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(ValueError, match="no vocabulary"):
            bad.encode("x")
    with pytest.raises(ValueError, match="byte table"):
        Tokenizer(read)  # type: ignore[arg-type]


class _Bytes(TextTokenizer):
    """A vocabulary of the 256 bytes and an end token: the interface's own methods only."""

    def __init__(self) -> None:
        self.token_bytes = [bytes([b]) for b in range(256)] + [b""]
        self.vocab_size, self.eos_ids, self.eos_id = 257, (256,), 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def token_text(self, token_id: int) -> str:
        return "<end>" if token_id == 256 else self.token_bytes[token_id].decode("latin-1")

    def special_tokens(self) -> list[str]:
        return ["<end>"]

    def token_id(self, text: str) -> int | None:
        return 256 if text == "<end>" else None

    def to_json(self) -> str:
        raise NotImplementedError


def test_a_vocabulary_of_another_kind_decodes_and_streams_through_the_interface() -> None:
    """A tokenizer that implements :class:`TextTokenizer` gets decoding and the streaming
    detokenizer from its byte table: a character split across tokens comes out whole."""
    tok = _Bytes()
    ids = tok.encode("día ✓")
    assert tok.decode([*ids, 256]) == "día ✓"
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == "día ✓"
    assert "" in pieces and all("\ufffd" not in p for p in pieces)
    assert isinstance(Tokenizer.from_file(ROOT / "weights" / "tokenizer.json"), TextTokenizer)
