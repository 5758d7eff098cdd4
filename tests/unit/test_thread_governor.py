"""The worker's thread governor on made-up loads: when it gives up a thread, when it tries one
again, what it looks at; that the kernel's run-delay counter shows a thread waiting for a core;
and that the thread count changes no logit (what lets it switch between any two steps).
tests/server/test_placement.py watches it on a real server beside a busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from radixserve.worker.thread_governor import (
    RETRY_MAX_SECONDS,
    RETRY_SECONDS,
    STALL_LIMIT,
    WINDOW_SECONDS,
    ProcessRunDelay,
    ThreadGovernor,
)


class FakeMachine:
    """A clock and a run-delay counter the test moves by hand: `forward(seconds, stall)` is a
    forward during which the worker's threads waited `stall` of its time for a core."""

    def __init__(self, max_threads: int = 2) -> None:
        self.now = 100.0
        self.delay = 3.0
        self.applied: list[int] = []
        self.governor = ThreadGovernor(max_threads, self, self.applied.append, clock=lambda: self.now)

    def read(self) -> float:
        return self.delay

    def refresh(self) -> None:
        pass

    def forward(self, seconds: float, stall: float) -> None:
        self.governor.before_step()
        self.now += seconds
        self.delay += stall * seconds
        self.governor.after_step()

    def window(self, stall: float) -> int:
        """One window of forwards; the thread count after it."""
        for _ in range(5):
            self.forward(WINDOW_SECONDS / 5 + 1e-6, stall)
        return self.governor.threads


def test_a_stalled_window_gives_up_a_thread_and_a_trial_takes_it_back() -> None:
    machine = FakeMachine()
    assert machine.window(0.1) == 2 and machine.applied == []  # a little waiting: kept
    assert machine.window(0.7) == 1 and machine.governor.stall == pytest.approx(0.7, rel=1e-3)
    # before RETRY_SECONDS have passed, no trial
    while machine.now < 100.0 + 2 * WINDOW_SECONDS + RETRY_SECONDS - WINDOW_SECONDS:
        assert machine.window(0.0) == 1
    machine.now += RETRY_SECONDS
    assert machine.window(0.0) == 2  # the trial starts
    assert machine.window(0.1) == 2  # and holds: the thread is kept
    assert machine.applied == [1, 2]


def test_each_failed_trial_waits_twice_as_long_for_the_next() -> None:
    machine = FakeMachine()
    assert machine.window(0.7) == 1
    waits = []
    for _ in range(6):
        given_up = machine.now
        while machine.window(0.0) == 1:  # forwards alone on one thread stall nothing
            pass
        waits.append(machine.now - given_up)
        assert machine.window(0.7) == 1  # the trial stalls: given up again
    expected = [min(RETRY_SECONDS * 2 ** i, RETRY_MAX_SECONDS) for i in range(6)]  # 1, 2, 4, 8, 8, 8
    assert waits == pytest.approx(expected, abs=2 * WINDOW_SECONDS)
    # a trial that holds resets the wait
    while machine.window(0.0) == 1:
        pass
    assert machine.window(0.1) == 2
    assert machine.window(0.7) == 1
    given_up = machine.now
    while machine.window(0.0) == 1:
        pass
    assert machine.now - given_up == pytest.approx(RETRY_SECONDS, abs=2 * WINDOW_SECONDS)


def test_only_a_full_window_of_forwards_decides_and_the_time_between_them_does_not_count() -> None:
    machine = FakeMachine()
    forwards = 0.0
    while forwards + 0.02 < WINDOW_SECONDS:
        machine.forward(0.02, 1.0)
        forwards += 0.02
        assert machine.governor.threads == 2
        # between forwards the worker waits for its next batch: no forward to slow down
        machine.now += 0.5
        machine.delay += 0.5
    machine.forward(0.02, 1.0)
    assert machine.governor.threads == 1 and machine.governor.stall == pytest.approx(1.0)


def test_many_threads_are_given_up_and_tried_one_at_a_time() -> None:
    machine = FakeMachine(max_threads=4)
    counts = [machine.window(2.0) for _ in range(4)]
    assert counts == [3, 2, 1, 1]
    machine.now += RETRY_SECONDS
    assert machine.window(0.0) == 2
    assert machine.window(0.0) == 2  # held; the next trial waits RETRY_SECONDS again
    machine.now += RETRY_SECONDS
    assert [machine.window(0.0) for _ in range(2)] == [3, 3]
    assert STALL_LIMIT < 0.7


def test_the_run_delay_of_this_process_grows_while_its_threads_wait() -> None:
    """A thread pinned to this process's core, beside a busy process on the same core, waits
    for it: the counter sees the wait."""
    if not hasattr(os, "sched_setaffinity") or not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"):
        pytest.skip("needs Linux affinity and per-thread schedstat")
    counter = ProcessRunDelay()
    core = min(os.sched_getaffinity(0))
    mask = os.sched_getaffinity(0)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)
        first = counter.read()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        assert counter.read() - first > 0.1  # sharing a core for 0.5 s: waiting about half of it
    finally:
        os.sched_setaffinity(0, mask)
        busy.kill()
        busy.wait()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_thread_count_changes_no_logit(default_model_dir, dtype) -> None:
    """What lets the governor resize the pool between any two steps: the default model's logits
    (its quantized layers, the widened prefill path, attention, norms) are the same bits on one
    thread and on two, for a prefill long enough to take the prefill paths and a decode step."""
    from radixserve.config import ServerConfig
    from radixserve.worker.model_runner import SequenceChunk
    from radixserve.worker.worker import Worker

    worker = Worker(ServerConfig(model=str(default_model_dir), dtype=dtype, kv_pages=96, page_size=16))
    worker.page_table.assign(0, list(range(0, 48)))
    worker.page_table.assign(1, list(range(48, 96)))
    long_prompt, short_prompt = [(i * 37) % 5000 + 100 for i in range(600)], [101, 2, 3, 4, 5]
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            prefill = worker.runner.forward([SequenceChunk(0, 0, long_prompt, all_logits=True),
                                             SequenceChunk(1, 0, short_prompt)])
            decode = worker.runner.forward([SequenceChunk(0, 600, [7]), SequenceChunk(1, 5, [8])])
            outputs.append((prefill.all_logits[0], prefill.last_logits, decode.last_logits))
    finally:
        torch.set_num_threads(threads)
        worker.close()
    for one, two in zip(*outputs, strict=True):
        assert torch.equal(one, two)
