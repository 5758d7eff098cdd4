"""The grammar compile process: where xgrammar compiles a client's grammar, so that a compile
running past its time can be killed.

A compile cannot be stopped from outside while it runs in a thread. Some grammars that pass every
check before compiling take minutes (a flat JSON schema with a few hundred patterned properties
does), and a thread would keep a core and its memory for all of that time after the client got
its 400. Here each compile runs in a process of its own, forked from this one, which has
imported xgrammar and built the vocabulary tables once (so a fork costs milliseconds, not the
seconds of a fresh start). When the scheduler cancels a compile (scheduler/grammar.py: it ran
out of time, or nobody waits for it), its process is killed, and the core and memory it held are
free at once. An xgrammar crash on a hostile grammar ends that one process, not the scheduler.

This process runs at a lower CPU priority (`NICENESS`), and so do its forks: a compile never
takes a core from the worker's decoding. It speaks msgpack frames over its stdin and stdout:
first a `CompileSetup` (the tokenizer's vocabulary, as xgrammar serializes it), answered by
`CompileReady`; then `CompileOrder`s and `CancelOrder`s in any order, each order answered by
one `CompileResult` (the compiled grammar serialized by xgrammar, or the reason it cannot be
compiled), unless it was cancelled first. Nothing is pickled.

    python -m radixserve.scheduler.grammar_child     # started by scheduler/grammar.py only
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import msgspec

from radixserve.ipc import die_with_parent

if TYPE_CHECKING:
    import xgrammar as xgr

NICENESS = 10  # added to the scheduler's: decoding goes first when both want the CPU
_POLL_S = 0.05  # how often running compiles' CPU time is checked
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_FRAME_HEADER = struct.Struct("<Q")  # a frame: its length, then that many msgpack bytes
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:[0-9]+: ")  # "[04:56:49] /project/cpp/x.cc:83: "
_XGRAMMAR_CHECK = re.compile(r"Check failed: \(.*?\) is false: ")


class CompileSetup(msgspec.Struct, tag=True):
    """The first frame: what every compile needs (xgrammar's `TokenizerInfo.serialize_json`)."""

    tokenizer_info: str


class CompileReady(msgspec.Struct, tag=True):
    """The answer to `CompileSetup`: the process can compile now."""


class CompileOrder(msgspec.Struct, tag=True):
    order_id: int
    kind: str  # protocol.Grammar's kinds: json_schema, regex, ebnf, structural_tag
    text: str
    cpu_seconds: float | None  # the CPU time it may take before it is killed; None: no limit


class CancelOrder(msgspec.Struct, tag=True):
    """Kill the order's compile; no result follows (an order already answered is ignored)."""

    order_id: int


class CompileResult(msgspec.Struct, tag=True):
    """`compiled` (xgrammar's `CompiledGrammar.serialize_json`), or `error` saying why not, or
    `timed_out`: killed when it had used its CPU time."""

    order_id: int
    compiled: str | None = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0  # the compile's own time (of CPU, when it timed out)



def write_frame(stream: IO[bytes], message: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(message)
    view = memoryview(_FRAME_HEADER.pack(len(data)) + data)
    while view:  # an unbuffered write may take part of it
        view = view[stream.write(view) :]


def read_frame(stream: IO[bytes], kind: Any) -> Any:
    """The next frame as `kind` (a message type or a union of them), or None when the other
    side closed the pipe. `stream` is unbuffered: the callers `select` on it, and a buffer
    could hold a second frame where `select` cannot see it."""
    header = _read_exactly(stream, _FRAME_HEADER.size)
    if header is None:
        return None
    (length,) = _FRAME_HEADER.unpack(header)
    data = _read_exactly(stream, length)
    return None if data is None else msgspec.msgpack.decode(data, type=kind)


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = stream.read(size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def clean_message(exc: BaseException) -> str:
    """xgrammar's message without the C++ time stamp and source position."""
    lines = [_XGRAMMAR_CHECK.sub("", _XGRAMMAR_PREFIX.sub("", line)).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


def compile_kind(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """One grammar of a kind the API accepts, compiled."""
    import xgrammar

    if kind == "json_schema":
        # one layout (`{"a": 1, "b": [2, 3]}`), no free whitespace: a model cannot loop on
        # spaces or newlines until max_new_tokens, a known failure of whitespace-free grammars
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:  # SGLang's legacy shape
            try:
                items = [
                    xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in tag["structures"]
                ]
            except (KeyError, TypeError):
                raise ValueError('each of "structures" needs "begin", "schema" and "end"') from None
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def check_not_empty(compiled: xgr.CompiledGrammar) -> None:
    """A grammar whose language is empty (`root ::= root`) compiles, but no token may ever
    start it: refuse it here rather than sample from a mask that allows nothing."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bitmask.any() and not matcher.is_terminated():
        raise ValueError("the grammar allows no output at all")


@dataclass
class RunningCompile:
    """A compile in its own forked process."""

    pid: int
    results: IO[bytes]  # the pipe its one `CompileResult` comes on
    cpu_seconds: float | None  # its budget of CPU time

    def cpu_used(self) -> float:
        """CPU time the process has used so far (user and system), from /proc."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime

    def end(self, kill: bool = False) -> None:
        if kill:
            os.kill(self.pid, signal.SIGKILL)
        self.results.close()
        os.waitpid(self.pid, 0)


def serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """Answer compile orders until the scheduler closes the pipe (or kills us)."""
    setup = read_frame(requests, CompileSetup)
    if setup is None:
        return
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(setup.tokenizer_info)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(replies, CompileReady())
    running: dict[int, RunningCompile] = {}  # by order id
    try:
        while True:
            pipes = {compile.results: order_id for order_id, compile in running.items()}
            readable, _, _ = select.select([requests, *pipes], [], [], _POLL_S if running else None)
            for pipe in [p for p in readable if p is not requests]:
                order_id = pipes[pipe]
                result = read_frame(pipe, CompileResult)
                running.pop(order_id).end()
                write_frame(replies, result or CompileResult(order_id, error="the grammar compiler died on it"))
            for order_id, compile in list(running.items()):
                used = compile.cpu_used()
                if compile.cpu_seconds is not None and used > compile.cpu_seconds:
                    running.pop(order_id).end(kill=True)
                    write_frame(replies, CompileResult(order_id, timed_out=True, seconds=used))
            if requests in readable:
                message = read_frame(requests, CompileOrder | CancelOrder)
                if message is None:
                    return
                if isinstance(message, CancelOrder):
                    if message.order_id in running:
                        running.pop(message.order_id).end(kill=True)
                else:
                    running[message.order_id] = _fork_compile(compiler, message)
    finally:
        for compile in running.values():
            compile.end(kill=True)


def _fork_compile(compiler: xgr.GrammarCompiler, order: CompileOrder) -> RunningCompile:
    """Compile `order` in a forked process, which writes its `CompileResult` and exits."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        die_with_parent(watch=False)
        os.close(read_fd)
        start = time.perf_counter()
        try:
            compiled = compile_kind(compiler, order.kind, order.text)
            check_not_empty(compiled)
            result = CompileResult(order.order_id, compiled=compiled.serialize_json())
        except BaseException as exc:  # noqa: BLE001 - any failure is the grammar's, said to its client
            result = CompileResult(order.order_id, error=clean_message(exc))
        result.seconds = time.perf_counter() - start
        with os.fdopen(write_fd, "wb", buffering=0) as out:
            write_frame(out, result)
        os._exit(0)
    os.close(write_fd)
    return RunningCompile(pid, os.fdopen(read_fd, "rb", buffering=0), order.cpu_seconds)


def main() -> None:
    die_with_parent(watch=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    os.nice(NICENESS)
    requests, replies = os.fdopen(0, "rb", buffering=0), os.fdopen(1, "wb", buffering=0)
    sys.stdout = sys.stderr  # a stray print must not corrupt a frame
    serve(requests, replies)


if __name__ == "__main__":
    main()
