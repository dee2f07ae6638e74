"""Incremental tokenisation of prompts that extend an earlier prompt.

Stateless chat clients resend the whole conversation, so turn 30 would re-tokenise ~25k
characters (about 5 ms here) only to find, in the prefix cache, that all but the last
message was seen before. This keeps the token ids of recent prompts and encodes only what a
new prompt adds: the last ``OVERLAP`` tokens of the earlier prompt are re-encoded together
with the new text, and the splice is used only if they come out unchanged (so the pre-token
boundaries before them cannot have moved); otherwise the whole text is encoded.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

from linserve.model.tokenizer import TextTokenizer

OVERLAP = 8
KEY_CHARS = 64  # candidates are found by the prompt's first characters
MIN_CHARS = 2048  # shorter prompts are cheap to encode whole


class PromptTokens:
    def __init__(self, tok: TextTokenizer, capacity: int = 128) -> None:
        self.tok = tok
        self.capacity = capacity
        self.recent: OrderedDict[str, list[tuple[str, array[int]]]] = OrderedDict()
        self._lock = threading.Lock()  # next turns are tokenized in a thread too

    def encode(self, text: str) -> list[int]:
        """``tok.encode(text)``, reusing an earlier prompt that ``text`` extends."""
        if len(text) < MIN_CHARS:
            return self.tok.encode(text)
        key = text[:KEY_CHARS]
        with self._lock:
            candidates = list(self.recent.get(key, []))
        ids = self._extend(text, candidates)
        if ids is None:
            ids = self.tok.encode(text)
        self._remember(key, text, ids)
        return ids

    def _extend(self, text: str, candidates: list[tuple[str, array[int]]]) -> list[int] | None:
        best = max((c for c in candidates if text.startswith(c[0]) and len(c[1]) > OVERLAP),
                   key=lambda c: len(c[0]), default=None)
        if best is None:
            return None
        old_text, old_ids = best
        last = old_ids[-OVERLAP:].tolist()
        tail = self.tok.decode(last)
        if not old_text.endswith(tail):
            return None  # the tail splits a character: no safe splice
        fresh = self.tok.encode(tail + text[len(old_text) :])
        if fresh[:OVERLAP] != last:
            return None
        return old_ids[:-OVERLAP].tolist() + fresh

    def _remember(self, key: str, text: str, ids: list[int]) -> None:
        with self._lock:
            entries = [e for e in self.recent.pop(key, []) if not text.startswith(e[0])]
            self.recent[key] = [*entries[-1:], (text, array("i", ids))]
            while len(self.recent) > self.capacity:
                self.recent.popitem(last=False)
