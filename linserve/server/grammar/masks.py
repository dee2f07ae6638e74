"""Token masks for the constrained rows of a batch: llguidance fills the packed bitmask
(``linserve.model.sampling.TokenMask``) that the sampler reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

from linserve.model.sampling import TokenMask


class MaskBuilder:
    """Fills the next-token bitmasks of many matchers in one call (llguidance's own thread
    pool, outside the GIL) into a reused ``[B, ceil(V/32)]`` buffer."""

    def __init__(self, vocab_size: int, threads: int = 1) -> None:
        self.words = (vocab_size + 31) // 32
        self.executor = LLExecutor(num_threads=threads)
        self._bits = np.full((64, self.words), -1, dtype=np.int32)

    def build(self, matchers: Sequence[LLMatcher | None]) -> tuple[TokenMask | None, list[int]]:
        """The batch's mask (None when no row has a matcher), and the rows whose matcher is in
        an error state (a dead end: the engine fails them; their row is left open)."""
        dead = [i for i, m in enumerate(matchers) if m is not None and m.is_error()]
        live = [(m, i) for i, m in enumerate(matchers) if m is not None and i not in dead]
        if not live and not dead:
            return None, []
        if self._bits.shape[0] < len(matchers):
            self._bits = np.full((2 * len(matchers), self.words), -1, dtype=np.int32)
        bits = self._bits[: len(matchers)]
        bits.fill(-1)
        if live:
            fill_next_token_bitmask_par(self.executor, live, bits)
        rows = torch.tensor([i for _, i in live], dtype=torch.long)
        return TokenMask(torch.from_numpy(bits), rows), dead
