"""The engine's view of structured outputs: a matcher per constrained request, and the masks
of a batch's constrained rows. Built on first use, so a server that never sees a grammar
never loads the grammar engine's tokenizer.

The masks of a decode step depend only on the tokens already accepted, so the engine starts
computing them (:meth:`EngineGrammars.start`, on a worker thread; llguidance runs outside
the GIL) before the model step and collects them after it: on a machine with a core to
spare for it, the masks cost the step almost nothing.

A grammar new to the engine is compiled by :meth:`EngineGrammars.prepare` in the thread that
submits the request (the engine process's command pump), so the loop itself only copies
compiled templates and never stalls the batch for a compile."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLMatcher

from linserve.model.sampling import TokenMask
from linserve.model.tokenizer import TextTokenizer
from linserve.server.grammar.compiler import GrammarCompiler
from linserve.server.grammar.masks import MaskBuilder
from linserve.server.grammar.spec import GrammarSpec

MaskResult = tuple[TokenMask | None, list[int]]  # the batch's mask, and its dead-end rows
log = logging.getLogger("linserve.grammar")


def matcher_error(matcher: LLMatcher | None) -> str:
    """The first line of a matcher's error (llguidance appends a multi-line state dump)."""
    lines = (matcher.get_error() or "").strip().splitlines() if matcher is not None else []
    return lines[0] if lines else "unknown grammar error"


class EngineGrammars:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._masks: MaskBuilder | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _compiled(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
            return self._compiler

    def prepare(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` now, in the calling thread, if it is new. A failure is left for
        :meth:`matcher` to report against its request."""
        try:
            self._compiled().template(spec)
        except Exception as exc:
            log.debug("grammar not prepared: %s", exc)

    def matcher(self, spec: GrammarSpec) -> LLMatcher:
        """A fresh matcher for one request's output (raises ``GrammarError``)."""
        return self._compiled().matcher(spec)

    def masks(self, matchers: Sequence[LLMatcher | None]) -> MaskResult:
        """The batch's mask (None when no row is constrained) and its dead-end rows."""
        if all(m is None for m in matchers):
            return None, []
        if self._masks is None:
            self._masks = MaskBuilder(self._vocab_size)
        return self._masks.build(matchers)

    def start(self, matchers: Sequence[LLMatcher | None]
              ) -> Future[MaskResult] | None:
        """:meth:`masks` on the worker thread (None when no row is constrained). The matchers
        must not advance until the result is taken."""
        if all(m is None for m in matchers):
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._worker.submit(self.masks, list(matchers))
