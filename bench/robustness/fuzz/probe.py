"""The plain stream probe: one more client, beside the plan's, that streams an ordinary /generate
request (`PROBE_BODY`: 64 new tokens, greedy, unconstrained) again and again and times the gaps
between its chunks; first a few times on the idle server, then for as long as the plan runs.
The bar for a server under hostile load, that a concurrent plain stream's worst token gap
stays within 2x of an idle server's measured in the same run, is read off its figures
(`probe_figures`); they are a measurement, not part of the oracle's verdict.

It runs in a process of its own: the plan's clients encode and parse megabyte bodies on their
event loop, and a probe on that loop (or in a thread, behind the GIL) would time the fuzzer as
much as the server."""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.robustness.fuzz.encoding import json_or_none
from bench.robustness.fuzz.oracle import error_code

PROBE_BODY = {"text": "The capital of France is",
              "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}, "stream": True}
IDLE_STREAMS = 3  # measured on the idle server, after one that warms it up


@dataclass(frozen=True)
class StreamTimes:
    """One probe stream: the seconds between its consecutive chunks (the first chunk's wait is
    no gap), how it ended (`ok`, `aborted`: an `abort_all` of the plan reached it, `overloaded`:
    the documented 503, or `failed: why`), when it ran and when its worst gap began, on
    `time.monotonic`'s clock (the same in every process of the machine: the run finds what it
    sent meanwhile)."""

    gaps: tuple[float, ...]
    end: str
    span: tuple[float, float] = (0.0, 0.0)
    worst_at: float | None = None

    @classmethod
    def timed(cls, started: float, chunks: list[float], end: str) -> StreamTimes:
        """From the request's start and its chunks' arrival times; it ends now."""
        gaps = tuple(b - a for a, b in zip(chunks, chunks[1:]))
        worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
        return cls(gaps, end, (started, time.monotonic()), None if worst is None else chunks[worst])


def stream_once(client: httpx.Client) -> StreamTimes:
    """Send `PROBE_BODY` once and time its chunks."""
    chunks: list[float] = []
    finish, started = None, time.monotonic()
    try:
        with client.stream("POST", "/generate", json=PROBE_BODY) as response:
            if response.status_code != 200:
                body = response.read()
                if response.status_code == 503 and error_code(body) == "overloaded":
                    return StreamTimes.timed(started, [], "overloaded")
                return StreamTimes.timed(started, [], f"failed: {response.status_code} {body[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return StreamTimes.timed(started, chunks, "aborted" if finish == "abort" else "ok")
                chunks.append(time.monotonic())
                event = json_or_none(line[6:].encode())
                if not isinstance(event, dict) or "error" in event:
                    return StreamTimes.timed(started, chunks, f"failed: the event {line[:300]}")
                finish = ((event.get("meta_info") or {}).get("finish_reason") or {}).get("type") or finish
    except httpx.HTTPError as exc:
        return StreamTimes.timed(started, chunks, f"failed: {type(exc).__name__}: {exc}")
    return StreamTimes.timed(started, chunks, "failed: the stream ended without [DONE]")


def _probe_process(url: str, idle_streams: int, timeout: float, go: Any, stop: Any, out: Any) -> None:
    """The probe's process: a warm-up stream, `idle_streams` measured ones, then (once `go` is
    set) streams until `stop` is; each put on `out` with its phase, and a marker after each phase."""
    with httpx.Client(base_url=url, timeout=timeout) as client:
        stream_once(client)
        for _ in range(idle_streams):
            out.put(("idle", stream_once(client)))
        out.put(("idle-done", None))
        go.wait()
        while not stop.is_set():
            out.put(("during", stream_once(client)))
    out.put(("end", None))


class StreamProbe:
    """The probe's process and the streams it timed, by phase (`idle`, `during`). Its methods
    block: an asyncio caller runs them in a thread."""

    def __init__(self, url: str, idle_streams: int = IDLE_STREAMS, timeout: float = 60.0) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process running an event loop
        self._go, self._stop, self._out = context.Event(), context.Event(), context.Queue()
        self._process = context.Process(target=_probe_process, name="fuzz-probe", daemon=True,
                                        args=(url, idle_streams, timeout, self._go, self._stop, self._out))
        self._wait = timeout + 30  # one stream's timeout, and the process's start
        self.streams: dict[str, list[StreamTimes]] = {"idle": [], "during": []}

    def measure_idle(self) -> None:
        """Start the process; return once its idle streams are done."""
        self._process.start()
        self._collect("idle", "idle-done")

    def start_during(self) -> None:
        self._go.set()

    def finish(self) -> None:
        """Stop after the stream in progress; collect the rest."""
        self._stop.set()
        self._go.set()
        self._collect("during", "end")
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()

    def _collect(self, phase: str, marker: str) -> None:
        while True:
            try:
                got, times = self._out.get(timeout=self._wait)
            except queue.Empty:
                self.streams[phase].append(StreamTimes((), f"failed: the probe reported nothing in {self._wait:g} s"))
                return
            if got == marker:
                return
            self.streams[got].append(times)


def worst_gap(streams: Sequence[StreamTimes]) -> tuple[float, float] | None:
    """The worst gap of these streams as (start, end) on `time.monotonic`'s clock."""
    timed = [s for s in streams if s.worst_at is not None]
    if not timed:
        return None
    worst = max(timed, key=lambda s: max(s.gaps))
    return worst.worst_at, worst.worst_at + max(worst.gaps)


def phase_figures(streams: Sequence[StreamTimes]) -> dict[str, Any]:
    """One phase's streams: how they ended, and their gaps (worst, 99th percentile, median) in ms."""
    gaps = sorted(g for s in streams for g in s.gaps)

    def ms(seconds: float) -> float:
        return round(seconds * 1000, 2)

    return {
        "streams": len(streams), "ends": dict(Counter(s.end.split(":")[0] for s in streams)), "gaps": len(gaps),
        "worst_gap_ms": ms(gaps[-1]) if gaps else None,
        "p99_gap_ms": ms(gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]) if gaps else None,
        "median_gap_ms": ms(statistics.median(gaps)) if gaps else None,
    }


def probe_figures(idle: Sequence[StreamTimes], during: Sequence[StreamTimes]) -> dict[str, Any]:
    """Both phases' figures and the ratio the bar reads: the worst gap during the run over the
    idle server's worst (None when a phase timed no gap)."""
    figures = {"idle": phase_figures(idle), "during": phase_figures(during)}
    idle_worst, during_worst = figures["idle"]["worst_gap_ms"], figures["during"]["worst_gap_ms"]
    ratio = round(during_worst / idle_worst, 2) if idle_worst and during_worst is not None else None
    return {**figures, "worst_gap_ratio": ratio}
