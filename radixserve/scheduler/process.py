"""The scheduler process: the loop that turns front messages into worker steps and back."""

from __future__ import annotations

import logging

from radixserve.config import ServerConfig
from radixserve.ipc import Endpoints, Receiver, Sender, start_child
from radixserve.protocol import (
    AbortRequest,
    FlushCache,
    ForwardBatch,
    ForwardResult,
    FrontToScheduler,
    GetStats,
    SchedulerReady,
    Shutdown,
    TokenBatchOut,
    TokenizedRequest,
    WorkerFailed,
    WorkerReady,
    WorkerToScheduler,
)
from radixserve.scheduler.core import Scheduler
from radixserve.scheduler.request import Request
from radixserve.scheduler.stop import StopChecker

log = logging.getLogger("radixserve.scheduler")

IDLE_POLL_MS = 50


class WorkerDied(RuntimeError):
    """The worker reported a failure; the scheduler exits and the watchdog fails all requests."""


def run_scheduler(config: ServerConfig, endpoints: Endpoints) -> None:
    ctx = start_child(config.log_level)
    from_front: Receiver = Receiver(ctx, endpoints.front_to_scheduler, bind=True, msg_type=FrontToScheduler)
    to_front = Sender(ctx, endpoints.scheduler_to_front, bind=False)
    from_worker: Receiver = Receiver(ctx, endpoints.worker_to_scheduler, bind=True, msg_type=WorkerToScheduler)
    to_worker = Sender(ctx, endpoints.scheduler_to_worker, bind=False)

    ready = from_worker.recv()
    if not isinstance(ready, WorkerReady):
        log.error("%s", getattr(ready, "message", f"unexpected first message {ready!r}"))
        raise SystemExit(1)
    scheduler = Scheduler(config, ready, _stop_checker_factory(ready.model_path))
    to_front.send(SchedulerReady(**{f: getattr(ready, f) for f in WorkerReady.__struct_fields__}))

    def forward(batch: ForwardBatch) -> ForwardResult:
        to_worker.send(batch)
        result = from_worker.recv()
        if isinstance(result, WorkerFailed):
            raise WorkerDied(result.message)
        return result

    try:
        while True:
            msg = from_front.recv(timeout_ms=0 if scheduler.has_work else IDLE_POLL_MS)
            while msg is not None:
                if isinstance(msg, Shutdown):
                    return
                _handle(scheduler, msg, to_front)
                msg = from_front.recv(timeout_ms=0)
            batch = scheduler.build_batch()
            if batch is not None:
                scheduler.process_result(forward(batch))
            else:
                cleanup = scheduler.pending_worker_cleanup()
                if cleanup is not None:
                    forward(cleanup)
            if scheduler.outputs:
                to_front.send(TokenBatchOut(scheduler.outputs))
                scheduler.outputs = []
    except WorkerDied as exc:
        log.error("worker failed: %s", exc)
        raise SystemExit(1) from exc


def _handle(scheduler: Scheduler, msg: object, to_front: Sender) -> None:
    if isinstance(msg, TokenizedRequest):
        rejected = scheduler.add_request(msg)
        if rejected is not None:
            to_front.send(rejected)
    elif isinstance(msg, AbortRequest):
        scheduler.abort(msg.rid)
    elif isinstance(msg, FlushCache):
        to_front.send(scheduler.flush_cache(msg.req_id))
    elif isinstance(msg, GetStats):
        to_front.send(scheduler.stats(msg.req_id))


def _stop_checker_factory(model_path: str):
    """Stop strings need the tokenizer; load it only when a request first has some."""
    tokenizer = None

    def make(req: Request) -> StopChecker | None:
        nonlocal tokenizer
        if not req.sampling.stop:
            return None
        if tokenizer is None:
            from radixserve.front.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        return StopChecker(tokenizer, req.sampling, req.input_ids)

    return make
