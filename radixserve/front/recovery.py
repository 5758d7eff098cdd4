"""Recovery from a dead scheduler or worker: what the front keeps of each request in flight, so
a fresh engine can carry on with it, and the bridge from the watchdog's thread to the front.

The front is the owner of recovery because it already holds every request's prompt and every
token it has passed on. When the engine dies, the launcher (`launch.Backend.watch`) starts a new
scheduler and worker; the front then submits each unfinished request again, as a
`TokenizedRequest` whose `resume` lists each unfinished sample's outputs so far. The new engine
recomputes prompt + outputs (through its prefix cache) and samples from there: greedy outputs
continue exactly, a seeded sample continues its own sequence (its draws depend on seed and step
only, `worker.sampler.SamplingState.generator`), and the client's stream just pauses. KV
bookkeeping starts empty in the new engine; nothing of the old one is trusted.

A poison request, one that itself makes a step fail, would crash every engine it is sent to.
When the scheduler can still say which submissions were in the failing step (`EngineFailed`:
an exception in the scheduler or the worker), each of them counts a crash; a request with a
crash runs alone in the next engine until it samples a token (`TokenizedRequest.isolate`), so
a second crash names it and nothing else, and it then fails alone (HTTP 500) while the others go
on. A process killed outright (a signal, a segfault) names nobody: everything is resumed, and
the restart budget bounds a crash loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from radixserve.front.types import RequestCrashedEngine
from radixserve.ipc import Endpoints
from radixserve.protocol import EngineFailed, RequestOutput, ResumedSample, TokenizedRequest

if TYPE_CHECKING:
    from radixserve.front.manager import TokenizerManager
    from radixserve.front.types import GenerateRequest

log = logging.getLogger("radixserve.recovery")

POISON_CRASHES = 2  # failing steps a request was in, with no token between, before it fails alone
EVENT_TIMEOUT_S = 30.0  # how long the watchdog waits for the front's loop to take an event


@dataclass(eq=False)
class LiveRequest:
    """One submission in flight: where its outputs go, and what a fresh engine needs to go on
    with it (each sample's outputs as they came, one group per `RequestOutput`)."""

    internal: int  # the front's internal id (TokenizedRequest.rid), kept across restarts
    request: GenerateRequest
    queue: asyncio.Queue
    groups: list[list[list[int]]] = field(default_factory=list)  # per sample: new_token_ids, in order
    finished: list[bool] = field(default_factory=list)
    # per sample: the cache figures the engine reported (cached, segment, recomputed tokens)
    reported: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_logprobs_received: bool = False
    sent: bool = False  # submitted to an engine (False: it arrived while one restarted)
    crashes: int = 0  # failing steps it was in since it last sampled a token

    def __post_init__(self) -> None:
        n = self.request.sampling.n
        self.groups = [[] for _ in range(n)]
        self.finished = [False] * n
        self.reported = [(0, 0, 0)] * n

    def record(self, out: RequestOutput) -> None:
        """Note an output as it is dispatched to the caller (before the caller reads it)."""
        if out.new_token_ids:
            self.groups[out.index].append(out.new_token_ids)  # the decoded message's own list
            self.crashes = 0
        self.reported[out.index] = (out.cached_tokens, out.segment_tokens, out.recomputed_tokens)
        if out.input_logprobs:
            self.prompt_logprobs_received = True
        if out.finish is not None:
            self.finished[out.index] = True

    @property
    def done(self) -> bool:
        return all(self.finished)

    def submission(self) -> TokenizedRequest:
        """The message that starts it, or resumes it on a fresh engine if it was sent before."""
        req = self.request
        resume = []
        if self.sent:
            resume = [
                ResumedSample(i, groups, *reported)
                for i, (groups, reported, finished) in enumerate(
                    zip(self.groups, self.reported, self.finished, strict=True)
                )
                if not finished
            ]
        return TokenizedRequest(
            rid=self.internal, input_ids=req.input_ids, sampling=req.sampling,
            return_logprob=req.return_logprob,
            # the caller has the prompt's logprobs already: the new engine need not score it again
            logprob_start_len=-1 if self.prompt_logprobs_received else req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num, cache_salt=req.cache_salt,
            resume=resume, isolate=self.crashes > 0,
            segments=req.segments, segment_recompute_ratio=req.segment_recompute_ratio,
        )


class Restarts:
    """The front's record of engine restarts: why one is under way, the dead engine's last
    word, which requests were suspects of each crash, and the counts the metrics report.

    The `TokenizerManager` owns the sockets and the requests; it tells this record when an engine
    died and when a fresh one is ready, and resubmits what `engine_restarted` hands back."""

    def __init__(self) -> None:
        self.restarting: str | None = None  # why, while a fresh engine starts
        self.restarts = 0  # engines restarted (radixserve_engine_restarts_total)
        self.recovered = 0  # requests resumed on a restarted engine (radixserve_requests_recovered_total)
        self._failure: EngineFailed | None = None  # the dying engine's last word, if it had one
        self._last_failure = ""  # why the last engine died (named to a poison request)

    def engine_failed(self, failure: EngineFailed) -> None:
        """The engine reported its own failure (an exception in the scheduler or the worker),
        just before it dies."""
        self._failure = failure

    def engine_died(self, reason: str, requests: dict[int, LiveRequest]) -> str:
        """Count a crash against each suspect the dead engine named; returns the full reason."""
        failure, self._failure = self._failure, None
        if failure is not None:
            reason = f"{reason}: {failure.message}"
            for internal in failure.suspects:
                live = requests.get(internal)
                if live is not None:
                    live.crashes += 1
        self.restarting = self._last_failure = reason
        return reason

    def engine_restarted(self, requests: list[LiveRequest]) -> list[LiveRequest]:
        """A fresh engine is ready: the requests to submit again. A request that was in the
        failing step of `POISON_CRASHES` engines in a row fails alone instead."""
        self.restarting = None
        self.restarts += 1
        resume = []
        for live in requests:
            if live.done:
                continue  # its caller is reading the last outputs
            if live.crashes >= POISON_CRASHES:
                log.error("request %r was in the failing step of %d engines in a row: it fails alone",
                          live.request.rid, live.crashes)
                live.queue.put_nowait(RequestCrashedEngine(live.request.rid, self._last_failure))
                continue
            if live.sent:  # else it arrived during the restart: new, not recovered
                self.recovered += 1
            resume.append(live)
        log.info("engine restarted; %d requests resumed so far", self.recovered)
        return resume

    def gave_up(self) -> None:
        """No engine is coming back."""
        self.restarting = None


class BackendEvents:
    """`launch.EngineEvents` for a `TokenizerManager`: runs each event in the manager's loop and
    waits for it, so the watchdog closes the old sockets only once the front is done with them.

    `on_lost` (the HTTP server's exit) runs after the manager has failed every request."""

    def __init__(
        self, manager: TokenizerManager, loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self._manager = manager
        self._loop = loop
        self._on_lost = on_lost

    def engine_died(self, reason: str) -> None:
        self._run(self._manager.engine_died, reason)

    def engine_restarted(self, endpoints: Endpoints, receiver: zmq.Socket) -> None:
        self._run(self._manager.engine_restarted, endpoints, receiver)

    def engine_lost(self, reason: str) -> None:
        log.error("%s: giving up; every request fails", reason)
        self._run(self._manager.fail_all, reason)
        if self._on_lost is not None:
            self._on_lost(reason)

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        async def call() -> None:
            fn(*args)

        coro: Coroutine[Any, Any, None] = call()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed: the front is shutting down
            coro.close()
            return
        try:
            future.result(EVENT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            log.error("the front's event loop did not take %s within %g s", fn.__name__, EVENT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the watchdog must go on (restart, or report the loss)
            log.exception("the front failed to take %s", fn.__name__)
