"""Tokenizer round trips and the incremental detokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from linserve.model.tokenizer import Tokenizer, train_tokenizer

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
