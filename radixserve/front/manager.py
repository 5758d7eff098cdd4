"""The front's side of the runtime: send tokenized requests, turn token batches into results.

Used by the HTTP server and by `Engine`. It owns the internal request ids (a caller's rid is a
label mapped to one), per-request output streams (each sample's text, ids and logprobs:
`sample_output.py`), abort on cancel, and failing every in-flight request with a clear error when
the scheduler or worker dies.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.front.sample_output import PromptLogprobs, SampleOutput
from radixserve.ipc import Endpoints
from radixserve.protocol import (
    AbortRequest,
    FlushCache,
    FlushCacheDone,
    GetStats,
    RequestRejected,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    SchedulerToFront,
    TokenBatchOut,
    TokenizedRequest,
)


class RequestFailed(RuntimeError):
    """A request could not be served. `retryable` (queue full) maps to HTTP 503."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class EngineDead(RequestFailed):
    """The scheduler or worker process is gone; nothing will be served until a restart."""


class RidInUse(RequestFailed):
    """The caller's rid labels a request still in flight (HTTP 409): rids name requests for
    `abort`, so two live ones cannot share one."""

    def __init__(self, rid: str) -> None:
        super().__init__(
            f"request id {rid!r} is in use by a request in flight; pick another, or wait for it to finish"
        )
        self.rid = rid


@dataclass
class GenerateRequest:
    """A validated, tokenized request as the front submits it.

    `rid` is the caller's label: echoed as `meta_info.id`, unique among this front's requests in
    flight, and what `abort` takes. It never leaves the front: each submission travels under an
    internal id of its own (`TokenizedRequest.rid`), so a label can be reused the moment its
    request ends, and can never name a sample or another request inside the runtime.
    """

    input_ids: list[int]
    sampling: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    cache_salt: str | None = None
    tenant: str | None = None  # from the API key (--api-key-file); only the front's metrics read it


class TokenizerManager:
    """Talks to the scheduler over ZMQ from an asyncio loop.

    It owns the mapping between callers' rids (labels) and internal ids: every submission gets
    the next int of a counter, outputs are routed by it alone, and a submission's queue is gone
    once it ends, so late outputs of an aborted request are dropped, never delivered to a new
    request that reuses the label.
    """

    def __init__(self, endpoints: Endpoints, ready: SchedulerReady, tokenizer: Any) -> None:
        self.ready = ready
        self.tokenizer = tokenizer
        self._to_scheduler = zmq.Context.instance().socket(zmq.PUSH)
        self._to_scheduler.setsockopt(zmq.LINGER, 0)
        self._to_scheduler.connect(endpoints.front_to_scheduler)
        self._encoder = msgspec.msgpack.Encoder()
        self._queues: dict[int, asyncio.Queue] = {}  # internal id -> that submission's outputs
        # (tenant, caller's rid) -> internal id, while in flight: with --api-key-file each tenant's
        # rids are its own, so one tenant can neither see (409) nor abort another's requests
        self._live: dict[tuple[str | None, str], int] = {}
        self._ids = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}
        self._req_ids = itertools.count()
        self._dead: str | None = None
        self._from_scheduler: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None

    def start(self, receiver: zmq.Socket) -> None:
        """Adopt the bound scheduler->front socket into the running loop and start dispatching."""
        self._from_scheduler = zmq.asyncio.Socket.from_socket(receiver)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _send(self, msg: msgspec.Struct) -> None:
        self._to_scheduler.send(self._encoder.encode(msg))

    async def _recv_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(SchedulerToFront)
        assert self._from_scheduler is not None
        while True:
            msg = decoder.decode(await self._from_scheduler.recv())
            if isinstance(msg, TokenBatchOut):
                for out in msg.outputs:
                    queue = self._queues.get(out.rid)
                    if queue is not None:
                        queue.put_nowait(out)
            elif isinstance(msg, RequestRejected):
                queue = self._queues.get(msg.rid)
                if queue is not None:
                    queue.put_nowait(RequestFailed(msg.message, msg.retryable))
            elif isinstance(msg, (FlushCacheDone, SchedulerStats)):
                fut = self._replies.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def fail_all(self, reason: str) -> None:
        """The backend died: every waiting caller gets an error now instead of hanging."""
        self._dead = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDead(reason))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))
        self._replies.clear()

    async def _ask(self, msg_type: type, timeout: float) -> Any:
        if self._dead:
            raise EngineDead(self._dead)
        req_id = next(self._req_ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[req_id] = fut
        self._send(msg_type(req_id))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(req_id, None)

    async def stats(self, timeout: float = 5.0) -> SchedulerStats:
        return await self._ask(GetStats, timeout)

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheDone:
        return await self._ask(FlushCache, timeout)

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
        if not self._dead:
            self._send(AbortRequest(internal))

    async def shutdown(self) -> None:
        """Stop dispatching; the backend's own `stop` ends the processes."""
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
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
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[internal] = queue
        self._live[live_key] = internal
        finished = False
        try:
            self._send(
                TokenizedRequest(
                    rid=internal, input_ids=req.input_ids, sampling=req.sampling,
                    return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                    top_logprobs_num=req.top_logprobs_num, cache_salt=req.cache_salt,
                )
            )
            while not all(s.done for s in states):
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                state = states[item.index]
                state.apply(item)
                yield self._result(req, state, item.index, start)
            finished = True
        finally:
            del self._queues[internal], self._live[live_key]
            if not finished:
                self._abort(internal)

    def _result(self, req: GenerateRequest, state: SampleOutput, index: int, start: float) -> dict[str, Any]:
        now = time.monotonic()
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(state.output_ids),
            "cached_tokens": state.cached_tokens,
            "finish_reason": state.finish,
            "e2e_latency": now - start,
        }
        if state.done:
            meta["ttft"] = (state.first_token_time or now) - start
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
