"""Replays: states rebuilt by prefilling a few tokens into an earlier state, run by the
engine under each iteration's token budget (never as one long stall of the batch).

Two users: a session whose state must end exactly where the client's text ends
(``linserve.server.sessions.transcript``), and the prefix cache's entry after a chat reply, whose
canonical re-tokenisation differs from the tokens the model sampled.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from linserve.model.interface import ServedModel, State

log = logging.getLogger("linserve.engine")


@dataclass
class Replay:
    """Prefill ``feed`` into ``state``; then ``done(state)``, or ``failed(error)``."""

    state: State
    feed: list[int]
    done: Callable[[State], None]
    failed: Callable[[Exception], None]
    label: str = ""


class ReplayQueue:
    def __init__(self, model: ServedModel, chunk: int) -> None:
        self.model, self.chunk = model, chunk
        self.jobs: deque[Replay] = deque()

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, job: Replay) -> None:
        self.jobs.append(job)

    def run(self, budget: int) -> int:
        """Advance the queued replays in order under ``budget`` tokens; returns what is left.
        A job with nothing (left) to feed finishes at once, whatever the budget: a KV row cut
        back to exactly its target has nothing to prefill, and must not block the queue."""
        while self.jobs:
            job = self.jobs[0]
            if job.feed:
                n = self.model.prefill_split(len(job.feed), self.chunk, max(budget, 0))
                if n <= 0:
                    break  # the budget left is less than one aligned chunk
                try:
                    _, job.state = self.model.prefill(torch.tensor([job.feed[:n]]), job.state)
                except Exception as exc:
                    log.exception("replay %s failed", job.label)
                    self.jobs.popleft()
                    job.failed(exc)
                    continue
                job.feed = job.feed[n:]
                budget -= n
            if not job.feed:
                self.jobs.popleft()
                job.done(job.state)
        return budget

    def fail_all(self, exc: Exception) -> None:
        jobs, self.jobs = self.jobs, deque()
        for job in jobs:
            job.failed(exc)
