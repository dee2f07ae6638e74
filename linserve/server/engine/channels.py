"""The HTTP process's handles on an engine process, torch-free: the channels it is given
(:func:`channels`), a prelaunched one (:class:`Prelaunched`) and the entry points a new
process starts in (:func:`engine_entry`, :func:`waiting_entry`), which import the engine's
side (:mod:`.child`: torch and the model code) only there, in the engine process."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from linserve.server.engine.description import ModelDescription


@dataclass
class Prelaunched:
    """A forked engine process checking the checkpoint, then waiting for its settings on
    ``go``, and what it was given: the verdict queue (``(problem or None, the largest
    importable state, the model described)``, once), the command and output queues, the
    ready event and the heartbeat (:func:`channels`)."""

    process: Any
    verdict: Any
    go: Any
    inbox: Any
    outbox: Any
    ready: Any
    heartbeat: Any
    taken: bool = False  # by the server's engine client, which then owns the process
    checked: tuple[str | None, int] | None = None  # the verdict, once read
    # the model described without its weights, with the verdict: its tokenizer is read here
    # while the engine loads
    description: ModelDescription | None = None

    def wait_verdict(self) -> tuple[str | None, int]:
        """The checkpoint's check: a problem's one line (None: it loads) and the bytes of
        its largest state (what an import may send); :attr:`description` is then set where
        it loads."""
        while self.checked is None:
            try:
                problem, limit, self.description = self.verdict.get(timeout=0.25)
                self.checked = problem, limit
            except queue.Empty:
                if not self.process.is_alive():
                    self.checked = (f"the engine process exited (exit code "
                                    f"{self.process.exitcode}) before it checked the model", 0)
        return self.checked

    def cancel(self) -> None:
        """Unless the server took the process: tell it that no settings will come, and it
        exits without a word."""
        if self.taken:
            return
        self.taken = True
        self.go.put(None)
        self.process.join(timeout=0.5)
        if self.process.is_alive():  # still loading on the command line's settings
            self.process.kill()


def channels(ctx: Any) -> tuple[Any, Any, Any, Any]:
    """What an engine process is given (:func:`.child.child_main`'s): its command and output
    queues, its ready event and its heartbeat (a shared double)."""
    return ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0, lock=False)


def engine_entry(*args: Any) -> None:
    """A spawned engine process's start: :func:`.child.child_main`."""
    from linserve.server.engine.child import child_main

    child_main(*args)


def waiting_entry(*args: Any) -> None:
    """A prelaunched engine process's start: :func:`.child.waiting_child`."""
    from linserve.server.engine.child import waiting_child

    waiting_child(*args)
