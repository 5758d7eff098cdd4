"""Constrained decoding, the scheduler's side: grammars compiled off the loop, cached, and one
matcher per sample that says which tokens may come next.

The scheduler owns every grammar fact: it compiles (xgrammar), keeps each sample's matcher in
step with its output tokens (through chunked prefill, retraction and resumption the matcher
simply stays with the `Request`), and sends the worker a token bitmask with each chunk that
samples. The worker only masks logits; it never sees a grammar.

Compiles run in processes of their own (scheduler/grammar_child.py), at a lower CPU priority
than decoding, never on the loop: the request waits in the queue instead. A compile that has used
`--grammar-compile-timeout` seconds of CPU time is killed, so the core and memory it held are
free at once, and its requests are refused (HTTP 400). CPU time, not time since the request
came: neither a queue of other grammars nor a machine busy decoding makes a grammar fail that
compiles in time on its own (a compile that takes `WALL_TIME_FACTOR` times its budget in wall
time is refused all the same, so every request is answered). One that nobody waits for any
more (all its requests aborted) is killed too. At most `MAX_QUEUED_COMPILES`
grammars wait for a process; a new grammar beyond that is refused as overload (503), so a flood
of slow grammars cannot push another client's into a wait without end.

A request resumed after an engine restart compiled its grammar before the restart: its compile
goes first, and it is never refused for taking long (the restarted engine recompiles everything
at once, from an empty cache, while the worker loads its model).

Compiled grammars are cached by (kind, text): an agent that sends the same schema or tool list
on every call pays for its compile once, and a grammar that failed (or timed out) is refused
again at once. xgrammar (and the torch it imports) is imported by `import_xgrammar`, which the
scheduler calls on a thread while the worker loads the model; `warm_up` builds the vocabulary
tables and starts the first compile process then, so the first constrained request does not
wait for either.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from radixserve.ipc import stop_process
from radixserve.protocol import GRAMMAR_COMPILE_BUCKETS, Grammar
from radixserve.scheduler.grammar_child import (
    CancelOrder,
    CompileOrder,
    CompileReady,
    CompileResult,
    CompileSetup,
    read_frame,
    write_frame,
)

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

PARALLEL_COMPILES = 4  # grammars compiled at once, each in a process of its own
CACHE_CAPACITY = 256  # compiled grammars kept (LRU)
COMPILE_TIMEOUT_S = 5.0  # CPU seconds a compile may use, then it is killed and its requests refused
WALL_TIME_FACTOR = 10  # nor may it take more than this many times its CPU budget in wall time
MAX_QUEUED_COMPILES = 32  # distinct grammars waiting for a compile process; a new one beyond is 503
START_TIMEOUT_S = 120.0  # a compile process's start (it imports xgrammar and torch)
_POLL_S = 0.05  # how often running compiles' deadlines and waiters are checked


# transformers' lazy module is not safe to import from two threads at once (one of them gets
# "cannot import name ..."): xgrammar imports it, and so does loading the tokenizer, so the
# scheduler's threads take this lock for either
IMPORT_LOCK = threading.Lock()


def import_xgrammar() -> ModuleType:
    """xgrammar, imported once (thread-safe)."""
    with IMPORT_LOCK:
        import xgrammar

        return xgrammar


class GrammarError(Exception):
    """A grammar that cannot be used: the client's error (HTTP 400), never the server's."""


class GrammarBusy(Exception):
    """Too many grammars wait to compile: the server's load (HTTP 503, retry later)."""


@dataclass(eq=False)
class CompileJob:
    """One grammar's compile, shared by every request that asks for the same (kind, text)."""

    grammar: Grammar
    future: Future = field(default_factory=Future)
    timed: bool = True  # False once a resumed request waits for it: never refused for its time
    waiters: int = 0  # requests waiting for it; a running compile with none left is killed
    timed_out: bool = False


@dataclass(eq=False)
class PendingGrammar:
    """A request's wait for its grammar (the n samples of one request share one)."""

    job: CompileJob
    given_up: bool = False

    def compiled(self) -> xgr.CompiledGrammar | None:
        """The compiled grammar once ready, None while it waits or compiles; raises
        `GrammarError` when the grammar is invalid or its compile ran out of time."""
        future = self.job.future
        if not future.done():
            return None
        exc = future.exception()
        if exc is not None:
            raise exc if isinstance(exc, GrammarError) else GrammarError(str(exc))
        return future.result()


@dataclass
class GrammarCounters:
    compiles: int = 0
    cache_hits: int = 0
    # cumulative counts per bound of GRAMMAR_COMPILE_BUCKETS, then one for +Inf (every compile)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1))
    seconds_sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.seconds_sum += seconds
        for i in range(bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, seconds), len(self.buckets)):
            self.buckets[i] += 1


class CompileProcess:
    """The compile process (scheduler/grammar_child.py): started when first needed, and again if
    it dies. Only the compile thread (`GrammarCompiler._run`) uses it."""

    def __init__(self, setup: Callable[[], CompileSetup]) -> None:
        self._setup = setup
        self._proc: subprocess.Popen | None = None

    @property
    def replies(self) -> IO[bytes] | None:
        return None if self._proc is None else self._proc.stdout

    def start(self) -> None:
        """Start the process unless it runs, and wait until it can compile (its start is the
        server's cost, never counted against a grammar's time). Raises OSError."""
        if self._proc is not None and self._proc.poll() is None:
            return
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.scheduler.grammar_child"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )
        try:
            write_frame(proc.stdin, self._setup())
            ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
            if not ready or read_frame(proc.stdout, CompileReady) is None:
                raise OSError(f"the grammar compile process did not start (exit code {proc.poll()})")
        except OSError:
            stop_process(proc, timeout=1.0)
            raise
        self._proc = proc

    def send(self, message: CompileOrder | CancelOrder) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        write_frame(self._proc.stdin, message)

    def receive(self) -> CompileResult | None:
        """The next result (the caller saw `replies` readable); None if the process died."""
        assert self._proc is not None and self._proc.stdout is not None
        return read_frame(self._proc.stdout, CompileResult)

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc, sig=signal.SIGKILL, timeout=5.0)
            self._proc = None


@dataclass(eq=False)
class DispatchedCompile:
    """A compile handed to the compile process, and when (its wall-time bound counts from then)."""

    job: CompileJob
    started: float  # monotonic, when the compile process got it


class GrammarCompiler:
    """Compiles grammars, `parallel` at a time, each in a process of its own, behind an LRU cache
    keyed by (kind, text)."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int], *,
        parallel: int = PARALLEL_COMPILES, capacity: int = CACHE_CAPACITY, timeout: float = COMPILE_TIMEOUT_S,
        max_queued: int = MAX_QUEUED_COMPILES,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout = timeout
        self._capacity = capacity
        self._max_running = parallel
        self._max_queued = max_queued
        self._jobs: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._queue: list[CompileJob] = []  # waiting for a process; resumed requests' go first
        self._running: dict[int, DispatchedCompile] = {}  # by order id; only the compile thread's
        self._order_ids = itertools.count()
        self._lock = threading.Lock()  # guards _jobs, _queue and the jobs' waiters (loop and thread)
        self._wake_read, self._wake_write = os.pipe()  # a byte here: a job was queued, or shut down
        self._closed = False
        self._warm_up_asked = False
        self._info: xgr.TokenizerInfo | None = None
        self._setup: CompileSetup | None = None
        self._init_lock = threading.Lock()
        self.counters = GrammarCounters()
        self._process = CompileProcess(self._compile_setup)
        threading.Thread(target=self._run, name="grammar-compiles", daemon=True).start()

    def compile(self, grammar: Grammar, *, resumed: bool = False) -> PendingGrammar:
        """Queue (or join, or reuse) the compile of `grammar`; never blocks. `resumed`: for a
        request that compiled it before an engine restart. Raises `GrammarBusy` when too many
        grammars already wait to compile."""
        key = (grammar.kind, grammar.text)
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and resumed and job.timed_out:
                job = None  # it compiled before the restart: it gets its time now
            if job is not None:
                self._jobs.move_to_end(key)
                self.counters.cache_hits += 1
            else:
                if not resumed and len(self._queue) >= self._max_queued:
                    raise GrammarBusy(f"{len(self._queue)} grammars are waiting to compile; retry later")
                job = CompileJob(grammar)
                self._jobs[key] = job
                self._queue.append(job)
                self.counters.compiles += 1
                while len(self._jobs) > self._capacity:
                    self._jobs.popitem(last=False)
                os.write(self._wake_write, b"q")
            if resumed:
                job.timed = False
            job.waiters += 1
        return PendingGrammar(job)

    def give_up(self, pending: PendingGrammar) -> None:
        """The request stopped waiting (refused, aborted). A compile nobody waits for any more
        is dropped from the queue, or killed if it runs: hostile grammars cannot keep work going
        that nobody waits for."""
        if pending.given_up:
            return
        pending.given_up = True
        job = pending.job
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and job.future.cancel():
                self._queue.remove(job)
                self._forget(job)

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A sample's own matcher; the model's EOS ids end the grammar (not the tokenizer's idea)."""
        return import_xgrammar().GrammarMatcher(compiled, override_stop_tokens=self.eos_token_ids)

    def new_bitmask(self) -> Any:
        """A one-row bitmask buffer (torch int32) for `fill_next_token_bitmask`."""
        return import_xgrammar().allocate_token_bitmask(1, self.vocab_size)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
        os.write(self._wake_write, b"x")

    def warm_up(self) -> None:
        """Load the tokenizer, build xgrammar's vocabulary tables and start the compile process
        now (at start), not when the first constrained request arrives."""
        self._warm_up_asked = True
        os.write(self._wake_write, b"w")

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._init_lock:
            if self._info is None:
                self._info = import_xgrammar().TokenizerInfo.from_huggingface(
                    self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids,
                )
            return self._info

    def _compile_setup(self) -> CompileSetup:
        info = self._tokenizer_info()
        with self._init_lock:
            if self._setup is None:
                self._setup = CompileSetup(info.serialize_json())
            return self._setup

    def _run(self) -> None:
        """The compile thread: hands queued grammars to the compile process (at most
        `parallel` at a time), takes its results, and cancels compiles that ran out of time or
        that nobody waits for any more."""
        try:
            while not self._closed:
                try:
                    self._step()
                except OSError as exc:  # the pipe to the compile process broke: it died
                    log.warning("the grammar compile process failed: %s", exc)
                    self._process_died()
        finally:
            for running in self._running.values():
                running.job.future.set_exception(GrammarError("the server is shutting down"))
            self._process.stop()

    def _step(self) -> None:
        if self._warm_up_asked:
            self._warm_up_asked = False
            self._start_process()
        self._start_queued()
        replies = self._process.replies
        watched = [self._wake_read] if replies is None else [self._wake_read, replies]
        readable, _, _ = select.select(watched, [], [], _POLL_S if self._running else None)
        if self._wake_read in readable:
            os.read(self._wake_read, 4096)
        if replies is not None and replies in readable:
            self._take_result()
        self._cancel_overdue()

    def _start_queued(self) -> None:
        """Send queued grammars to the compile process while fewer than `parallel` compile."""
        while len(self._running) < self._max_running and not self._closed:
            with self._lock:
                if not self._queue:
                    return
                job = next((j for j in self._queue if not j.timed), self._queue[0])  # a resumed one first
                self._queue.remove(job)
                if not job.future.set_running_or_notify_cancel():
                    continue
            if not self._start_process():
                job.future.set_exception(GrammarError("the grammar compiler is not available (see the server's log)"))
                continue
            order_id = next(self._order_ids)
            self._running[order_id] = DispatchedCompile(job, time.monotonic())
            budget = self.timeout if job.timed else None
            self._process.send(CompileOrder(order_id, job.grammar.kind, job.grammar.text, budget))

    def _start_process(self) -> bool:
        """Start the compile process unless it runs. Only this thread starts it: the process
        dies with the thread that started it (PR_SET_PDEATHSIG follows the thread)."""
        try:
            self._process.start()
        except OSError as exc:
            log.warning("%s", exc)
            return False
        return True

    def _take_result(self) -> None:
        result = self._process.receive()
        if result is None:
            self._process_died()
            return
        running = self._running.pop(result.order_id, None)
        if running is None:
            return  # cancelled meanwhile
        self.counters.observe(result.seconds)
        grammar = running.job.grammar
        if result.timed_out:
            self._time_out(running.job)
            return
        if result.error is not None:
            running.job.future.set_exception(GrammarError(f"invalid {grammar.kind}: {result.error}"))
            return
        assert result.compiled is not None
        try:
            compiled = import_xgrammar().CompiledGrammar.deserialize_json(result.compiled, self._tokenizer_info())
        except Exception as exc:  # noqa: BLE001 - the two processes disagree: refuse, and say why
            running.job.future.set_exception(GrammarError(f"the compiled {grammar.kind} could not be read back: {exc}"))
            return
        running.job.future.set_result(compiled)

    def _process_died(self) -> None:
        """Every compile in the process failed (one of them may have killed it); the next
        compile starts a new one."""
        self._process.stop()
        for running in self._running.values():
            running.job.future.set_exception(GrammarError(
                f"the grammar compiler failed on this {running.job.grammar.kind} (its process died)"
            ))
        self._running.clear()

    def _cancel_overdue(self) -> None:
        """Cancel the compiles nobody waits for any more, and those that have run far longer
        than their CPU budget in wall time (a machine too busy to give them the CPU)."""
        now = time.monotonic()
        for order_id, running in list(self._running.items()):
            job = running.job
            abandoned = job.waiters == 0
            if not abandoned and not (job.timed and now - running.started > self.timeout * WALL_TIME_FACTOR):
                continue
            del self._running[order_id]
            self._process.send(CancelOrder(order_id))
            self.counters.observe(now - running.started)
            if abandoned:
                with self._lock:
                    self._forget(job)
                job.future.set_exception(GrammarError("aborted"))
            else:
                self._time_out(job)

    def _time_out(self, job: CompileJob) -> None:
        job.timed_out = True
        job.future.set_exception(GrammarError(
            f"the {job.grammar.kind} did not compile within {self.timeout:g} s; simplify it"
        ))

    def _forget(self, job: CompileJob) -> None:
        key = (job.grammar.kind, job.grammar.text)
        if self._jobs.get(key) is job:
            del self._jobs[key]


__all__ = ["GrammarBusy", "GrammarCompiler", "GrammarError", "PendingGrammar"]
