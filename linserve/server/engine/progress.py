"""The engine's heartbeat counts progress, not iterations.

The supervisor (:class:`linserve.server.engine.process.ProcessEngineClient`) restarts an
engine whose heartbeat is older than ``--engine-stall-seconds``. Beating once per iteration
made one long iteration look like a hang: a 2,048-token prefill chunk of a 0.8B model in fp32
on two AVX2 cores takes longer than the 10 s default, and a 35B model's far longer, so the
server killed legitimate work and failed every request in flight.

:class:`ProgressWatch` beats from inside the work instead. A thread beside the engine reads
the engine thread's own CPU clock (``pthread_getcpuclockid``) a few times a stall period:
while that clock runs, the engine is computing (the thread takes part in every OpenMP
region of its products and runs every native step), so the heartbeat moves however long one
step is, at any model size. What it does not beat for:

- a stopped process (SIGSTOP, a debugger, a frozen cgroup): the watch thread stops too;
- a deadlock or a wait that never ends: the engine thread sleeps and its clock stops;
- a dead command pump: the beat callback itself declines (the process's ``beat``).

Each is noticed within the stall setting of the last progress and replaced as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# The engine thread must have run at least this share of the wall time between two looks
# for them to count as progress: an engine in a step runs ~100%, one blocked for good ~0%.
BUSY_SHARE = 0.2


class ProgressWatch:
    """Calls ``beat`` while ``thread`` uses CPU time (checked every ``interval`` seconds)."""

    def __init__(self, thread: threading.Thread, beat: Callable[[], None],
                 interval: float) -> None:
        if thread.ident is None:
            raise ValueError("the engine thread must be running before it is watched")
        self.clock = time.pthread_getcpuclockid(thread.ident)
        self.thread, self.beat, self.interval = thread, beat, interval
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._run, name="progress-watch", daemon=True)

    @classmethod
    def start(cls, thread: threading.Thread, beat: Callable[[], None],
              stall_seconds: float) -> ProgressWatch:
        """Watch ``thread``, looking four times a stall period (at most every 0.25 s)."""
        watch = cls(thread, beat, min(0.25, stall_seconds / 4))
        watch._watcher.start()
        return watch

    def stop(self) -> None:
        self._stop.set()

    def cpu_seconds(self) -> float:
        """The engine thread's CPU time so far."""
        return time.clock_gettime(self.clock)

    def _run(self) -> None:
        last = self.cpu_seconds()
        while not self._stop.wait(self.interval) and self.thread.is_alive():
            try:
                now = self.cpu_seconds()
            except OSError:  # the thread ended between the check and the read
                return
            if now - last >= BUSY_SHARE * self.interval:
                self.beat()
            last = now
