"""Constrained decoding, the scheduler's side: grammars compiled off the loop, cached, and one
matcher per sample that says which tokens may come next.

The scheduler owns every grammar fact: it compiles (xgrammar), keeps each sample's matcher in
step with its output tokens (through chunked prefill, retraction and resumption the matcher
simply stays with the `Request`), and sends the worker a token bitmask with each chunk that
samples. The worker only masks logits; it never sees a grammar.

xgrammar (and the torch it imports) is imported by `import_xgrammar`, which the scheduler calls
on a thread while the worker loads the model, so a server that never sees a grammar pays little
and the first constrained request does not wait for the import.

A compile runs on a small thread pool (xgrammar releases the GIL), so the loop never waits for
one: the request waits in the queue instead, and is refused (HTTP 400) when the compile fails
or takes longer than the timeout. Compiled grammars are cached by (kind, text): an agent that
sends the same schema or tool list on every call pays for its compile once.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from radixserve.protocol import GRAMMAR_COMPILE_BUCKETS, Grammar

if TYPE_CHECKING:
    import xgrammar as xgr

COMPILE_THREADS = 2
CACHE_CAPACITY = 256  # compiled grammars kept (LRU)
COMPILE_TIMEOUT_S = 5.0  # a request waits this long for its grammar, then is refused
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:[0-9]+: ")  # "[04:56:49] /project/cpp/x.cc:83: "
_XGRAMMAR_CHECK = re.compile(r"Check failed: \(.*?\) is false: ")


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


def _clean(exc: BaseException) -> str:
    """xgrammar's message without the C++ time stamp and source position."""
    lines = [_XGRAMMAR_CHECK.sub("", _XGRAMMAR_PREFIX.sub("", line)).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


@dataclass
class CompileJob:
    """One grammar's compile, shared by every request that asks for the same (kind, text)."""

    grammar: Grammar
    future: Future


@dataclass
class PendingGrammar:
    """A request's wait for its grammar: the shared job and when this request began waiting."""

    job: CompileJob
    since: float = field(default_factory=time.monotonic)

    def compiled(self, timeout: float, compiler_ready_at: float | None) -> xgr.CompiledGrammar | None:
        """The compiled grammar once ready, None while it compiles; raises `GrammarError` when
        the grammar is invalid or this request has waited longer than `timeout` (not counting
        the compiler's one-time set-up, until `compiler_ready_at`: the server's cost, not the
        grammar's)."""
        future = self.job.future
        if future.done():
            exc = future.exception()
            if exc is not None:
                raise GrammarError(f"invalid {self.job.grammar.kind}: {_clean(exc)}")
            return future.result()
        if compiler_ready_at is not None and time.monotonic() - max(self.since, compiler_ready_at) > timeout:
            raise GrammarError(f"the {self.job.grammar.kind} did not compile within {timeout:g} s; simplify it")
        return None


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


class GrammarCompiler:
    """Compiles grammars on a thread pool, behind an LRU cache keyed by (kind, text)."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int], *,
        threads: int = COMPILE_THREADS, capacity: int = CACHE_CAPACITY, timeout: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout = timeout
        self._capacity = capacity
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._jobs: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._xgr: xgr.GrammarCompiler | None = None
        self.ready_at: float | None = None  # when the xgrammar compiler was set up (monotonic)
        self._init_lock = threading.Lock()
        self._counters_lock = threading.Lock()  # compile threads add their times
        self.counters = GrammarCounters()

    def compile(self, grammar: Grammar) -> PendingGrammar:
        """Start (or join, or reuse) the compile of `grammar`; never blocks."""
        key = (grammar.kind, grammar.text)
        job = self._jobs.get(key)
        if job is not None and not job.future.cancelled():
            self._jobs.move_to_end(key)
            self.counters.cache_hits += 1
            return PendingGrammar(job)
        job = CompileJob(grammar, self._pool.submit(self._compile, grammar))
        self._jobs[key] = job
        self.counters.compiles += 1
        while len(self._jobs) > self._capacity:
            self._jobs.popitem(last=False)
        return PendingGrammar(job)

    def give_up(self, pending: PendingGrammar) -> None:
        """The request stopped waiting (timed out, aborted): a compile not yet started is
        cancelled, so hostile grammars cannot queue up work nobody waits for."""
        if pending.job.future.cancel():
            self._jobs.pop((pending.job.grammar.kind, pending.job.grammar.text), None)

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A sample's own matcher; the model's EOS ids end the grammar (not the tokenizer's idea)."""
        return import_xgrammar().GrammarMatcher(compiled, override_stop_tokens=self.eos_token_ids)

    def new_bitmask(self) -> Any:
        """A one-row bitmask buffer (torch int32) for `fill_next_token_bitmask`."""
        return import_xgrammar().allocate_token_bitmask(1, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """Load the tokenizer and build xgrammar's vocabulary tables now (on a thread, at
        start), not when the first constrained request arrives."""
        self._compiler()

    def _compiler(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._xgr is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids,
                )
                self._xgr = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self.ready_at = time.monotonic()
            return self._xgr

    def _check_not_empty(self, compiled: xgr.CompiledGrammar) -> None:
        """A grammar whose language is empty (`root ::= root`) compiles, but no token may ever
        start it: refuse it here rather than sample from a mask that allows nothing."""
        matcher = self.matcher(compiled)
        bitmask = self.new_bitmask()
        matcher.fill_next_token_bitmask(bitmask)
        if not bitmask.any() and not matcher.is_terminated():
            raise ValueError("the grammar allows no output at all")

    def _compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        compiler = self._compiler()
        start = time.perf_counter()
        try:
            compiled = _compile_kind(compiler, grammar)
            self._check_not_empty(compiled)
            return compiled
        finally:
            with self._counters_lock:
                self.counters.observe(time.perf_counter() - start)


def _compile_kind(compiler: xgr.GrammarCompiler, grammar: Grammar) -> xgr.CompiledGrammar:
    if grammar.kind == "json_schema":
        # one layout (`{"a": 1, "b": [2, 3]}`), no free whitespace: a model cannot loop on
        # spaces or newlines until max_new_tokens, a known failure of whitespace-free grammars
        return compiler.compile_json_schema(grammar.text, any_whitespace=False, strict_mode=True)
    if grammar.kind == "regex":
        return compiler.compile_regex(grammar.text)
    if grammar.kind == "ebnf":
        return compiler.compile_grammar(grammar.text)
    if grammar.kind == "structural_tag":
        tag = json.loads(grammar.text)
        if isinstance(tag, dict) and "structures" in tag:  # SGLang's legacy shape
            try:
                items = [
                    import_xgrammar().StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in tag["structures"]
                ]
            except (KeyError, TypeError):
                raise ValueError('each of "structures" needs "begin", "schema" and "end"') from None
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(grammar.text)
    raise ValueError(f"unknown grammar kind {grammar.kind!r}")


__all__ = ["GrammarCompiler", "GrammarError", "PendingGrammar"]
