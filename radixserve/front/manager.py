"""The front's side of the runtime: send tokenized requests, turn token batches into results.

Used by the HTTP server and by `Engine`. It owns the internal request ids (a caller's rid is a
label mapped to one), per-request output streams (each sample's text, ids and logprobs:
`sample_output.py`), abort on cancel, resuming every request in flight on a restarted engine
(`recovery.py`), and failing them with a clear error once no restart is left.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.front.recovery import LiveRequest, Restarts
from radixserve.front.sample_output import PromptLogprobs, SampleOutput
from radixserve.front.types import (
    EngineDead,
    GenerateRequest,
    RequestFailed,
    RidInUse,
    TooManyPinsInFlight,
)
from radixserve.ipc import Endpoints
from radixserve.protocol import (
    AbortRequest,
    EngineFailed,
    FlushCache,
    FlushCacheDone,
    GetStats,
    ListPins,
    PinDone,
    PinList,
    PinPrefix,
    RequestRejected,
    SchedulerStats,
    SchedulerToFront,
    TokenBatchOut,
    UnpinPrefix,
    WorkerInfo,
)

log = logging.getLogger("radixserve.front")

PIN_TIMEOUT_S = 600.0  # a pin may have a long document to prefill first


class TokenizerManager:
    """Talks to the scheduler over ZMQ from an asyncio loop.

    It owns the mapping between callers' rids (labels) and internal ids: every submission gets
    the next int of a counter, outputs are routed by it alone, and a submission's queue is gone
    once it ends, so late outputs of an aborted request are dropped, never delivered to a new
    request that reuses the label.
    """

    def __init__(self, endpoints: Endpoints, ready: WorkerInfo, tokenizer: Any) -> None:
        self.ready = ready
        self.tokenizer = tokenizer
        self._to_scheduler = self._connect(endpoints)
        self._encoder = msgspec.msgpack.Encoder()
        self._requests: dict[int, LiveRequest] = {}  # internal id -> that submission, while in flight
        # (tenant, caller's rid) -> internal id, while in flight: with --api-key-file each tenant's
        # rids are its own, so one tenant can neither see (409) nor abort another's requests
        self._live: dict[tuple[str | None, str], int] = {}
        self._ids = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}
        self._req_ids = itertools.count()
        self._dead: str | None = None
        self._restarts = Restarts()
        self._from_scheduler: zmq.asyncio.Socket | None = None
        self._receiver: zmq.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._decoder = msgspec.msgpack.Decoder(SchedulerToFront)

    @staticmethod
    def _connect(endpoints: Endpoints) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoints.front_to_scheduler)
        return sock

    def start(self, receiver: zmq.Socket) -> None:
        """Adopt the bound scheduler->front socket into the running loop and start dispatching."""
        self._receiver = receiver
        self._from_scheduler = zmq.asyncio.Socket.from_socket(receiver)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def restarting_reason(self) -> str | None:
        return self._restarts.restarting

    @property
    def restarts(self) -> int:
        """Engines restarted under this front."""
        return self._restarts.restarts

    @property
    def recovered(self) -> int:
        """Requests resumed on a restarted engine."""
        return self._restarts.recovered

    def _send(self, msg: msgspec.Struct) -> None:
        self._to_scheduler.send(self._encoder.encode(msg))

    async def _recv_loop(self) -> None:
        assert self._from_scheduler is not None
        while True:
            self._dispatch(self._decoder.decode(await self._from_scheduler.recv()))

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenBatchOut):
            for out in msg.outputs:
                live = self._requests.get(out.rid)
                if live is not None:
                    live.record(out)
                    live.queue.put_nowait(out)
        elif isinstance(msg, RequestRejected):
            live = self._requests.get(msg.rid)
            if live is not None:
                live.queue.put_nowait(RequestFailed(msg.message, msg.retryable))
        elif isinstance(msg, (FlushCacheDone, SchedulerStats, PinDone, PinList)):
            fut = self._replies.pop(msg.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EngineFailed):
            self._restarts.engine_failed(msg)

    # ------------------------------------------------------------------ engine restarts

    def engine_died(self, reason: str) -> None:
        """The scheduler or worker died (`recovery.BackendEvents`, in this loop). Read what the
        old engine sent to the end, so each request's record holds every token its caller will
        get; then hold every request until a fresh engine is ready."""
        self._stop_receiving()
        if self._receiver is not None:
            while self._receiver.poll(0):
                self._dispatch(self._decoder.decode(self._receiver.recv()))
            # closed here, in the loop: the asyncio socket unregisters its file descriptor, which
            # the fresh receiver may be given again (a stale registration would never wake)
            assert self._from_scheduler is not None
            self._from_scheduler.close(linger=0)
            self._from_scheduler = self._receiver = None
        reason = self._restarts.engine_died(reason, self._requests)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineDead(f"the engine is restarting ({reason})"))
        self._replies.clear()

    def engine_restarted(self, endpoints: Endpoints, receiver: zmq.Socket) -> None:
        """A fresh engine is ready: submit every request in flight again, each unfinished sample
        from its tokens so far; fail alone a request that crashed two engines in a row."""
        self._to_scheduler.close()
        self._to_scheduler = self._connect(endpoints)
        self.start(receiver)
        for live in self._restarts.engine_restarted(list(self._requests.values())):
            self._submit(live)

    def _submit(self, live: LiveRequest) -> None:
        self._send(live.submission())
        live.sent = True

    def _stop_receiving(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            self._recv_task = None

    def fail_all(self, reason: str) -> None:
        """The backend is gone for good: every waiting caller gets an error now instead of hanging."""
        self._dead = reason
        self._restarts.gave_up()
        for live in self._requests.values():
            live.queue.put_nowait(EngineDead(reason))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))
        self._replies.clear()

    async def _ask(self, make: Callable[[int], msgspec.Struct], timeout: float) -> Any:
        """Send `make(req_id)` to the scheduler and wait for the reply that names `req_id`."""
        if self._dead:
            raise EngineDead(self._dead)
        if self._restarts.restarting:
            raise EngineDead(f"the engine is restarting ({self._restarts.restarting})")
        req_id = next(self._req_ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[req_id] = fut
        self._send(make(req_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(req_id, None)

    async def stats(self, timeout: float = 5.0) -> SchedulerStats:
        return await self._ask(GetStats, timeout)

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheDone:
        return await self._ask(FlushCache, timeout)

    async def pin(self, input_ids: list[int], cache_salt: str | None, tier: str, ttl: float | None,
                  tenant: str | None = None, timeout: float = PIN_TIMEOUT_S, segment: bool = False) -> PinDone:
        """Pin a prefix (computed first if need be: the wait is a prefill's) for `tenant`, whose
        budgets the scheduler applies; with `segment`, a segment in the segment cache. A full
        waiting queue raises the retryable `RequestFailed` a request gets, the tenant's bound of
        pins in flight `TooManyPinsInFlight`; a pin that cannot be held is answered with its
        `error`."""
        done: PinDone = await self._ask(
            lambda req_id: PinPrefix(req_id, input_ids, cache_salt, tier, ttl, tenant, segment), timeout,
        )
        if done.pin is None and done.refusal == "queue_full":
            raise RequestFailed(done.error or "the waiting queue is full; retry later", retryable=True)
        if done.pin is None and done.refusal == "pins_in_flight":
            raise TooManyPinsInFlight(done.error or "too many pins are being made; retry later")
        return done

    async def unpin(self, pin_ids: list[int], input_ids: list[int], cache_salt: str | None,
                    timeout: float = 30.0, segment: bool = False) -> PinList:
        return await self._ask(lambda req_id: UnpinPrefix(req_id, pin_ids, input_ids, cache_salt, segment), timeout)

    async def pins(self, timeout: float = 30.0) -> PinList:
        return await self._ask(ListPins, timeout)

    def check_rids_free(self, rids: list[str], tenant: str | None = None) -> None:
        """Raise `RidInUse` before anything is sent, so a batch is refused whole; `generate`
        checks again for itself."""
        for rid in rids:
            if (tenant, rid) in self._live:
                raise RidInUse(rid)

    def abort(self, rid: str, tenant: str | None = None) -> bool:
        """Abort every sample of the tenant's request in flight labelled `rid`; False if there
        is none."""
        internal = self._live.get((tenant, rid))
        if internal is None:
            return False
        self._abort(internal)
        return True

    def abort_all(self, tenant: str | None = None) -> int:
        """Abort every request in flight (only the tenant's, given one); returns how many."""
        internal = [i for (t, _), i in self._live.items() if tenant is None or t == tenant]
        for i in internal:
            self._abort(i)
        return len(internal)

    def _abort(self, internal: int) -> None:
        """Tell the engine; while one restarts there is nothing to tell (the request is no
        longer in flight, so it is not resubmitted)."""
        if not self._dead and not self._restarts.restarting:
            self._send(AbortRequest(internal))

    async def shutdown(self) -> None:
        """Stop dispatching; the backend's own `stop` ends the processes."""
        task = self._recv_task
        self._stop_receiving()
        if task is not None:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._to_scheduler.close()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Yield one result dict per update of each sample (`index` says which), the last with
        `meta_info.finish_reason` set. Cancelling the consumer aborts the request."""
        if self._dead:
            raise EngineDead(self._dead)
        live_key = (req.tenant, req.rid)
        if live_key in self._live:
            raise RidInUse(req.rid)
        start = time.monotonic()
        prompt = PromptLogprobs()  # computed once, shared by the samples
        states = [SampleOutput(self.tokenizer, req.sampling, req.input_ids, prompt) for _ in range(req.sampling.n)]
        internal = next(self._ids)
        live = LiveRequest(internal, req, asyncio.Queue())
        self._requests[internal] = live
        self._live[live_key] = internal
        finished = False
        try:
            if not self._restarts.restarting:  # else it goes to the fresh engine with the others
                self._submit(live)
            while not all(s.done for s in states):
                item = await live.queue.get()
                if isinstance(item, Exception):
                    raise item
                state = states[item.index]
                state.apply(item)
                yield self._result(req, state, item.index, start)
            finished = True
        finally:
            del self._requests[internal], self._live[live_key]
            if not finished:
                self._abort(internal)

    def _result(self, req: GenerateRequest, state: SampleOutput, index: int, start: float) -> dict[str, Any]:
        now = time.monotonic()
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(state.output_ids),
            "cached_tokens": state.cached_tokens,
            "segment_tokens": state.segment_tokens,
            "recomputed_tokens": state.recomputed_tokens,
            "finish_reason": state.finish,
            "e2e_latency": now - start,
        }
        if state.done:
            meta["ttft"] = (state.first_token_time or now) - start
        if state.spec_accepted_tokens is not None:
            meta["spec_accepted_tokens"] = state.spec_accepted_tokens
        if req.return_logprob:
            meta.update(self._logprob_meta(req, state))
        return {"index": index, "text": state.visible_text, "output_ids": list(state.output_ids), "meta_info": meta}

    def _logprob_meta(self, req: GenerateRequest, state: SampleOutput) -> dict[str, Any]:
        def text(tid: int) -> str | None:
            return self.tokenizer.decode([tid]) if req.return_text_in_logprobs else None

        start = max(req.logprob_start_len, 0)
        prompt = state.prompt  # the request's, shared by its samples
        input_ids = req.input_ids[start:] if prompt.logprobs else []
        meta: dict[str, Any] = {
            "input_token_logprobs": [[lp, t, text(t)] for lp, t in zip(prompt.logprobs, input_ids, strict=True)],
            "output_token_logprobs": [[lp, t, text(t)] for lp, t in zip(state.output_logprobs, state.output_ids, strict=True)],
        }
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                [[lp, t, text(t)] for t, lp in top] or None for top in prompt.top_logprobs
            ]
            meta["output_top_logprobs"] = [[[lp, t, text(t)] for t, lp in top] for top in state.output_top_logprobs]
        return meta
