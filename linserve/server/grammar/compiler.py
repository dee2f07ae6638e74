"""Compiled grammars, cached by their text, and fresh matchers cut from them.

A matcher (llguidance's ``LLMatcher``) follows one output token by token and says which
tokens may come next. Building one parses the grammar and sets up its lexer (about 1 ms for
a typical JSON schema, up to ~100 ms for a large grammar); the cache keeps one built matcher
per grammar as a template, and every request gets a cheap ``deep_copy`` of it. An invalid
grammar is cached too, with its error, so resending it costs a lookup, not a compile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from llguidance import LLMatcher, LLTokenizer

from linserve.model.tokenizer import TextTokenizer
from linserve.server.grammar.spec import GrammarError, GrammarSpec

WHAT = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
        "choice": "choice list", "grammar": "grammar"}


class GrammarCompiler:
    """An LRU cache of compiled grammars (templates) for one tokenizer. Thread-safe."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, capacity: int = 256) -> None:
        self.tokenizer = LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                     eos_token=tokenizer.eos_id)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._templates: OrderedDict[tuple[str, str, str | None],
                                     LLMatcher | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def template(self, spec: GrammarSpec) -> LLMatcher:
        """The compiled grammar of ``spec`` (compiled on first use); raises
        :class:`GrammarError` with the engine's message when it is invalid."""
        key = (spec.kind, spec.source, spec.whitespace)
        with self._lock:
            found = self._templates.get(key)
            if found is not None:
                self._templates.move_to_end(key)
                self.hits += 1
        if found is None:
            found = self._compile(spec)
            with self._lock:
                self.misses += 1
                self._templates[key] = found
                while len(self._templates) > self.capacity:
                    self._templates.popitem(last=False)
        if isinstance(found, GrammarError):
            raise GrammarError(str(found), spec.param)
        return found

    def _compile(self, spec: GrammarSpec) -> LLMatcher | GrammarError:
        try:
            matcher = LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        except GrammarError as exc:
            return exc
        if matcher.is_error():
            return GrammarError(f"invalid {WHAT[spec.kind]}: {matcher.get_error().strip()}",
                                spec.param)
        matcher.compute_bitmask()  # builds the lexer's first states, which copies share
        return matcher

    def matcher(self, spec: GrammarSpec) -> LLMatcher:
        """A new matcher for one output, at the grammar's start."""
        return self.template(spec).deep_copy()
