"""The scheduler process: the loop that turns front messages into worker steps and back."""

from __future__ import annotations

import logging
import threading
import traceback

from radixserve.config import ServerConfig
from radixserve.ipc import Endpoints, Receiver, Sender, start_child
from radixserve.protocol import (
    AbortRequest,
    EngineFailed,
    FlushCache,
    ForwardBatch,
    ForwardResult,
    FrontToScheduler,
    GetStats,
    ListPins,
    PinPrefix,
    SchedulerReady,
    Shutdown,
    TokenizedRequest,
    UnpinPrefix,
    WorkerFailed,
    WorkerReady,
    WorkerToScheduler,
)
from radixserve.scheduler.core import Scheduler
from radixserve.scheduler.grammar import IMPORT_LOCK, GrammarCompiler, import_xgrammar
from radixserve.scheduler.request import Request
from radixserve.scheduler.stop import StopChecker

log = logging.getLogger("radixserve.scheduler")

IDLE_POLL_MS = 50
WAIT_POLL_MS = 2  # only requests whose grammars compile or disk pages load wait: look again soon, but do not spin


class WorkerDied(RuntimeError):
    """The worker reported a failure; the scheduler exits and the watchdog fails all requests."""


def run_scheduler(config: ServerConfig, endpoints: Endpoints) -> None:
    ctx = start_child(config.log_level, "radixserve::scheduler")
    from_front: Receiver = Receiver(ctx, endpoints.front_to_scheduler, bind=True, msg_type=FrontToScheduler)
    to_front = Sender(ctx, endpoints.scheduler_to_front, bind=False)
    from_worker: Receiver = Receiver(ctx, endpoints.worker_to_scheduler, bind=True, msg_type=WorkerToScheduler)
    to_worker = Sender(ctx, endpoints.scheduler_to_worker, bind=False)

    threading.Thread(target=import_xgrammar, name="import-xgrammar", daemon=True).start()
    ready = from_worker.recv()
    if not isinstance(ready, WorkerReady):
        log.error("%s", getattr(ready, "message", f"unexpected first message {ready!r}"))
        raise SystemExit(1)
    tokenizer = _LazyTokenizer(ready.info.model_path)
    grammars = GrammarCompiler(
        tokenizer.get, ready.info.vocab_size, ready.info.eos_token_ids, timeout=config.grammar_compile_timeout,
    )
    grammars.warm_up()  # its compile process starts now, not at the first constrained request
    scheduler = Scheduler(config, ready, _stop_checker_factory(tokenizer), grammars)
    to_front.send(SchedulerReady(ready.info))

    def forward(batch: ForwardBatch) -> ForwardResult:
        to_worker.send(batch)
        result = from_worker.recv()
        if isinstance(result, WorkerFailed):
            raise WorkerDied(result.message)
        return result

    try:
        while True:
            wait_ms = IDLE_POLL_MS if not scheduler.has_work else WAIT_POLL_MS if scheduler.only_waiting else 0
            msg = from_front.recv(timeout_ms=wait_ms)
            while msg is not None:
                if isinstance(msg, Shutdown):
                    write_back = scheduler.write_back_cache()  # the disk tier keeps the pool's pages
                    if write_back is not None:
                        forward(write_back)
                    to_worker.send_last(Shutdown())  # the worker exits beside this process, not after it
                    return
                _handle(scheduler, msg, to_front)
                msg = from_front.recv(timeout_ms=0)
            batch = scheduler.build_batch()
            if batch is not None:
                scheduler.process_result(forward(batch))
            else:
                cleanup = scheduler.pending_worker_cleanup()
                if cleanup is not None:
                    scheduler.absorb_worker_report(forward(cleanup))
            for out in scheduler.take_messages():
                to_front.send(out)
    except WorkerDied as exc:
        log.error("worker failed: %s", exc)
        _report_failure(to_front, f"the worker failed: {exc}", scheduler)
        raise SystemExit(1) from exc
    except Exception as exc:  # noqa: BLE001 - the front restarts the engine; say why, and who was in the step
        log.error("scheduler failed: %s", traceback.format_exc())
        _report_failure(to_front, f"the scheduler failed: {type(exc).__name__}: {exc}", scheduler)
        raise SystemExit(1) from exc
    finally:
        grammars.shutdown()


def _report_failure(to_front: Sender, message: str, scheduler: Scheduler) -> None:
    """The last message to the front: what failed and which submissions were in the step (the
    front blames them, so a request that fails the engine twice fails alone)."""
    to_front.send_last(EngineFailed(message, scheduler.in_flight_rids()))


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
    elif isinstance(msg, PinPrefix):
        refused = scheduler.pin(msg)
        if refused is not None:
            to_front.send(refused)
    elif isinstance(msg, UnpinPrefix):
        to_front.send(scheduler.unpin(msg))
    elif isinstance(msg, ListPins):
        to_front.send(scheduler.list_pins(msg.req_id))


class _LazyTokenizer:
    """Stop strings and grammars need the tokenizer; it is loaded when one first does (from a
    grammar compile thread too, hence the lock)."""

    def __init__(self, model_path: str) -> None:
        self._model_path = model_path
        self._tokenizer = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._tokenizer is None:
                with IMPORT_LOCK:  # not beside xgrammar's import (scheduler/grammar.py)
                    from radixserve.tokenizer import load_tokenizer

                    self._tokenizer = load_tokenizer(self._model_path)
            return self._tokenizer


def _stop_checker_factory(tokenizer: _LazyTokenizer):
    def make(req: Request) -> StopChecker | None:
        if not req.sampling.stop:
            return None
        return StopChecker(tokenizer.get(), req.sampling, req.input_ids)

    return make
