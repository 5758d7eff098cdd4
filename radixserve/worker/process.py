"""The worker process: wait for a ForwardBatch, run it, answer. Nothing else."""

from __future__ import annotations

import logging
import os
import traceback

from radixserve.config import ServerConfig
from radixserve.ipc import Endpoints, Receiver, Sender, start_child
from radixserve.placement import Placement, format_cpu_list, pin_worker, size_torch_threads
from radixserve.protocol import ForwardResult, SchedulerToWorker, Shutdown, WorkerFailed

log = logging.getLogger("radixserve.worker")


def run_worker(config: ServerConfig, endpoints: Endpoints, placement: Placement | None = None) -> None:
    """`placement` (the parent's decision, radixserve/placement.py) is applied first, before any
    thread starts or torch loads, so every pool the forward uses is on the worker's cores."""
    if placement is not None:
        pin_worker(placement)
    ctx = start_child(config.log_level, "radixserve::worker")
    inbox: Receiver = Receiver(ctx, endpoints.scheduler_to_worker, bind=True, msg_type=SchedulerToWorker)
    outbox = Sender(ctx, endpoints.worker_to_scheduler, bind=False)
    try:
        if placement is not None:
            _log_placement(placement, size_torch_threads(placement))
        import torch

        from radixserve.worker.device import use_device
        from radixserve.worker.thread_governor import worker_governor
        from radixserve.worker.worker import Worker

        use_device(config.device)
        worker = Worker(config)
        cpu_threads = torch.get_num_threads() if worker.device.type == "cpu" else 0  # ForwardResult.threads
        governor = None if config.disable_adaptive_threads else worker_governor(worker.device.type, cpu_threads)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported, then we exit
        log.error("worker failed to start: %s", traceback.format_exc())
        outbox.send(WorkerFailed(f"worker failed to start: {exc}"))
        return
    outbox.send(worker.ready_message())
    while True:
        msg = inbox.recv()
        if isinstance(msg, Shutdown):
            worker.close()
            return
        try:
            if governor is not None:
                governor.before_step()
            result: ForwardResult = worker.step(msg)
            result.threads = governor.threads if governor is not None else cpu_threads
            outbox.send(result)
            if governor is not None:
                governor.after_step()  # after the send: the scheduler need not wait for it
        except Exception as exc:  # noqa: BLE001 - a failed step must not hang the scheduler
            log.error("forward failed: %s", traceback.format_exc())
            outbox.send(WorkerFailed(f"forward failed: {exc}"))
            return


def _log_placement(placement: Placement, threads: int) -> None:
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    log.info("worker threads: %d; cores: %s", threads, "any" if cores is None else format_cpu_list(cores))
