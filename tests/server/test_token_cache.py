"""Incremental prompt tokenisation equals tokenising the whole text, for chat-like growth
and for adversarial cuts (mid-word, mid-character, whitespace runs)."""

from __future__ import annotations

import random

from linserve.model.tokenizer import Tokenizer
from linserve.server.sessions.token_cache import PromptTokens
from tests.paths import ROOT


def test_incremental_encoding_equals_full_encoding() -> None:
    tok = Tokenizer.from_file(ROOT / "weights" / "tokenizer.json")
    cache = PromptTokens(tok)
    rng = random.Random(0)
    pieces = ["User: what news?\n", "Assistant: None, my lord.\n", "  ", "\n\n", "café ",
              "Exeunt", "—", "2024", "'tis ", "ROMEO.", " ", "é"]
    for _ in range(20):
        text = "A hall in the castle. " * 120
        for _ in range(15):
            text += "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
            assert cache.encode(text) == tok.encode(text)
    assert cache.recent  # the long prompts were kept
