"""The worker process: wait for a ForwardBatch, run it, answer. Nothing else."""

from __future__ import annotations

import logging
import traceback

from radixserve.config import ServerConfig
from radixserve.ipc import Endpoints, Receiver, Sender, start_child
from radixserve.protocol import SchedulerToWorker, Shutdown, WorkerFailed

log = logging.getLogger("radixserve.worker")


def run_worker(config: ServerConfig, endpoints: Endpoints) -> None:
    ctx = start_child(config.log_level)
    inbox: Receiver = Receiver(ctx, endpoints.scheduler_to_worker, bind=True, msg_type=SchedulerToWorker)
    outbox = Sender(ctx, endpoints.worker_to_scheduler, bind=False)
    try:
        from radixserve.worker.worker import Worker

        worker = Worker(config)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported, then we exit
        log.error("worker failed to start: %s", traceback.format_exc())
        outbox.send(WorkerFailed(f"worker failed to start: {exc}"))
        return
    outbox.send(worker.ready_message())
    while True:
        msg = inbox.recv()
        if isinstance(msg, Shutdown):
            return
        try:
            outbox.send(worker.step(msg))
        except Exception as exc:  # noqa: BLE001 - a failed step must not hang the scheduler
            log.error("forward failed: %s", traceback.format_exc())
            outbox.send(WorkerFailed(f"forward failed: {exc}"))
            return
