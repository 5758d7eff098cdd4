"""How many threads the worker's forward runs on while other processes want its cores.

The worker's threads meet at a barrier after every parallel loop of every layer. When another
process takes turns with one of them on a core, that thread waits in the run queue, and its
partners wait for it at the next barrier, spinning (GNU OpenMP's default). So a process that
keeps one of the worker's cores busy slows it far more than giving up that core's thread would
(`python -m bench.cpu_contention`, docs/benchmarks.md). Short bursts (the front answering a
request, the scheduler, a client reading its stream) cost little: the thread waits a moment and
goes on.

So the worker measures what its forwards lose: the time its threads spent runnable but waiting
for a core (the kernel's `run_delay` in /proc/self/task/*/schedstat), as a share of the forwards'
time. After each window of forwards it gives up a thread when that share is above STALL_LIMIT.
A thread given up is tried again later, for one window, and kept if the stall stays low; each
failed try doubles the wait before the next one. Only the forwards count: between them the
worker waits for the scheduler anyway. Our kernels split work by rows, columns and heads, never
across a sum, so the thread count changes no result.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("radixserve.worker")

# the forward time one decision looks back over: enough forwards that one scheduler tick's
# preemption (a few ms) does not decide alone
WINDOW_SECONDS = 0.25
# The share of the forwards' time the threads may spend waiting for a core before one is
# given up: between what the front, the scheduler and a load generator on the same cores cause
# and what a process that keeps one of the cores busy does (docs/benchmarks.md measures both).
STALL_LIMIT = 0.5
# seconds before a thread given up is tried again; doubled after each try that stalls, up to
# RETRY_MAX_SECONDS, and back to RETRY_SECONDS after one that does not
RETRY_SECONDS = 1.0
RETRY_MAX_SECONDS = 8.0


class RunDelaySource(Protocol):
    def read(self) -> float:
        """Seconds this process's threads have waited for a core, so far."""

    def refresh(self) -> None:
        """Looks for threads started since the last call."""


class ProcessRunDelay:
    """The summed run_delay (seconds runnable but not running) of every thread of this process,
    from the kernel's per-thread schedstat (its second field, in ns). The files stay open, so a
    read costs a few microseconds a thread; `refresh` picks up new threads (an OpenMP pool
    grows when its thread count does)."""

    def __init__(self, task_dir: str = "/proc/self/task") -> None:
        self._task_dir = task_dir
        self._files: dict[str, int] = {}
        self.refresh()

    def refresh(self) -> None:
        for tid in os.listdir(self._task_dir):
            if tid not in self._files:
                try:
                    self._files[tid] = os.open(f"{self._task_dir}/{tid}/schedstat", os.O_RDONLY)
                except OSError:  # a thread that just ended
                    pass

    def read(self) -> float:
        total = 0
        for tid, fd in list(self._files.items()):
            try:
                total += int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # the thread ended: its delay no longer grows
                os.close(fd)
                del self._files[tid]
        return total / 1e9


class ThreadGovernor:
    """Chooses the worker's thread count after each forward, from the share of the last
    WINDOW_SECONDS of forwards its threads spent waiting for a core. `set_threads` applies a
    count (torch.set_num_threads: our kernels read it at every call). The clock and the delay
    counter are parameters so the decisions can be tested on made-up loads."""

    def __init__(self, max_threads: int, run_delay: RunDelaySource, set_threads: Callable[[int], None],
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self._run_delay = run_delay
        self._set_threads = set_threads
        self._clock = clock
        self._started: tuple[float, float] | None = None  # the forward's start: clock, run delay
        self._window_seconds = 0.0  # forward time in the window so far
        self._window_delay = 0.0  # thread-seconds waiting for a core during it
        self._retry_after = RETRY_SECONDS
        self._retry_at = 0.0  # when a thread given up may be tried again
        self._trying = False  # this window runs a thread taken back on trial
        self.stall = 0.0  # the last window's waiting as a share of its forward time

    def before_step(self) -> None:
        """Marks the start of a forward."""
        self._started = (self._clock(), self._run_delay.read())

    def after_step(self) -> None:
        """Adds the forward that just ended to the window; once the window is full, resizes the
        pool if its stall says so."""
        if self._started is None:
            return
        start, delay = self._started
        self._started = None
        now = self._clock()
        self._window_seconds += now - start
        self._window_delay += self._run_delay.read() - delay
        if self._window_seconds < WINDOW_SECONDS:
            return
        self.stall = max(0.0, self._window_delay / self._window_seconds)
        self._window_seconds = self._window_delay = 0.0
        self._run_delay.refresh()
        self._decide(now)

    def _decide(self, now: float) -> None:
        trial, self._trying = self._trying, False
        if self.stall > STALL_LIMIT and self.threads > 1:
            # a failed trial waits twice as long for the next; a fresh stall the base time
            self._retry_after = min(2 * self._retry_after, RETRY_MAX_SECONDS) if trial else RETRY_SECONDS
            self._retry_at = now + self._retry_after
            self._resize(self.threads - 1)
        elif trial:
            self._retry_after = RETRY_SECONDS
            self._retry_at = now + RETRY_SECONDS
        elif self.threads < self.max_threads and now >= self._retry_at:
            self._trying = True
            self._resize(self.threads + 1)

    def _resize(self, threads: int) -> None:
        log.debug("worker threads: %d -> %d (its threads waited for a core %.0f%% of its last forwards' time)",
                  self.threads, threads, 100 * self.stall)
        self._set_threads(threads)
        self.threads = threads


def worker_governor(device: str, max_threads: int) -> ThreadGovernor | None:
    """The governor for a CPU worker that runs on more than one thread, on a system with
    per-thread scheduler statistics (Linux); None where there is nothing to govern."""
    import torch

    if device != "cpu" or max_threads < 2 or not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"):
        return None
    return ThreadGovernor(max_threads, ProcessRunDelay(), torch.set_num_threads)
