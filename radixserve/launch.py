"""Starting and stopping the scheduler and worker processes, and watching them."""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import msgspec
import zmq

from radixserve.config import ServerConfig
from radixserve.ipc import Endpoints, Sender
from radixserve.kernels import isa
from radixserve.placement import Placement, plan, start_pinned
from radixserve.protocol import SchedulerReady, Shutdown, WorkerInfo
from radixserve.scheduler.process import run_scheduler
from radixserve.worker.process import run_worker

log = logging.getLogger("radixserve")


# how long a process whose partner exited on a failure of its own gets to report it and exit
REPORT_GRACE_S = 2.0


DISK_WRITE_BACK_S = 30.0  # at a stop, the most time added for writing the pool back to the disk tier

class StartupError(RuntimeError):
    pass


class EngineEvents(Protocol):
    """What the watchdog tells the front, from the watchdog's thread, in this order: the engine
    died; then it was restarted (its fresh sockets) or it is lost for good."""

    def engine_died(self, reason: str) -> None:
        """The processes are gone. Return only once nothing more will be read from the old
        `receiver`: the watchdog closes it next."""

    def engine_restarted(self, endpoints: Endpoints, receiver: zmq.Socket) -> None:
        """A fresh scheduler and worker are ready on `endpoints` (their outputs on `receiver`)."""

    def engine_lost(self, reason: str) -> None:
        """No restart is left (--max-restarts within --restart-window), or one failed to start."""


class RestartBudget:
    """At most `limit` restarts within any `window` seconds: a crash loop ends in a clear
    failure (and, for the server, a non-zero exit a supervisor acts on), not in restarts forever."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._times: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Spend one restart at `now`, if the budget has one."""
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True


class Backend:
    """The scheduler and worker processes of one server instance, and their private sockets.

    The caller binds the scheduler->front socket first (`receiver`), so no output is ever lost.
    After a crash the watchdog (`watch`) starts a fresh pair on fresh sockets, within the
    restart budget; `endpoints`, `receiver` and `processes` then name the new ones.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        try:
            # selected here, in the parent, so a bad RADIXSERVE_CPU_ISA fails before anything
            # starts and the torch caps it implies reach both children through the environment
            isa.selected_tier()
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        try:
            # decided here, once: the worker applies it, the ready log and /server_info show it
            self.placement: Placement = plan(config.num_threads, config.cpu_affinity)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        # restarts tried, for the log; the front counts those that took (radixserve_engine_restarts_total)
        self._attempts = 0
        self._budget = RestartBudget(config.max_restarts, config.restart_window)
        self._stopping = False
        self._watch_thread: threading.Thread | None = None
        self._create()

    def _create(self) -> None:
        """Fresh endpoints, the bound receiver, and the two (unstarted) processes."""
        self.endpoints = Endpoints.create()
        self.receiver = zmq.Context.instance().socket(zmq.PULL)
        self.receiver.setsockopt(zmq.LINGER, 0)
        self.receiver.bind(self.endpoints.scheduler_to_front)
        ctx = mp.get_context("spawn")  # no fork: torch and zmq state must not be inherited
        config = self.config
        self.worker = ctx.Process(target=run_worker, args=(config, self.endpoints, self.placement), name="radixserve-worker", daemon=True)
        self.scheduler = ctx.Process(target=run_scheduler, args=(config, self.endpoints), name="radixserve-scheduler", daemon=True)

    @property
    def processes(self) -> list[mp.process.BaseProcess]:
        return [self.scheduler, self.worker]

    def start(self) -> WorkerInfo:
        """Start both processes and wait until the model is loaded. Raises StartupError."""
        try:
            return self._start()
        except StartupError:
            self.stop()
            raise

    def _start(self) -> WorkerInfo:
        with _main_module_hidden():
            self.worker.start()  # pins itself (run_worker), every thread, before torch loads
            start_pinned(self.scheduler, self.placement.service_cpus)
        deadline = time.monotonic() + self.config.startup_timeout
        decoder = msgspec.msgpack.Decoder(SchedulerReady)
        while time.monotonic() < deadline and not self._stopping:
            if self.receiver.poll(200):
                return decoder.decode(self.receiver.recv()).worker
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise StartupError(
                    f"{dead[0].name} exited with code {dead[0].exitcode} during start-up; see its log above"
                )
        if self._stopping:
            raise StartupError("stopped during start-up")
        raise StartupError(f"the model did not load within {self.config.startup_timeout:.0f} s")

    def watch(self, events: EngineEvents) -> None:
        """Watch both processes from a thread: when either dies, stop the other, tell `events`,
        and start a fresh pair while the restart budget lasts."""

        def loop() -> None:
            while not self._stopping:
                dead = next((p for p in self.processes if not p.is_alive()), None)
                if dead is None:
                    time.sleep(0.1)
                    continue
                reason = f"the {dead.name.split('-')[-1]} process died (exit code {dead.exitcode})"
                if dead.exitcode is not None and dead.exitcode >= 0:
                    # it exited on a failure it reported (the worker's WorkerFailed): the
                    # scheduler is passing the report on (EngineFailed), then exits too
                    for p in self.processes:
                        p.join(REPORT_GRACE_S)
                self._kill_all()
                if self._stopping:
                    return
                log.error("%s", reason)
                events.engine_died(reason)
                if not self._restart(events, reason):
                    return

        self._watch_thread = threading.Thread(target=loop, name="radixserve-watchdog", daemon=True)
        self._watch_thread.start()

    def _restart(self, events: EngineEvents, reason: str) -> bool:
        """A fresh scheduler and worker on fresh sockets, tried again while the budget lasts if
        one fails to start; False (and `engine_lost`) when the budget is spent first, or the
        server is stopping."""
        while not self._stopping:
            if not self._budget.take(time.monotonic()):
                events.engine_lost(
                    f"{reason}, and {self._budget.limit} restarts within {self._budget.window:g} s were "
                    "spent already (--max-restarts, --restart-window)"
                )
                return False
            self._attempts += 1
            log.warning("restarting the scheduler and worker (restart %d)", self._attempts)
            self.receiver.close()
            self.endpoints.remove()
            self._create()
            try:
                self._start()
            except StartupError as exc:
                self._kill_all()
                reason = f"{reason}; restart {self._attempts} failed: {exc}"
                log.error("restart %d failed: %s", self._attempts, exc)
                continue
            if self._stopping:
                break
            log.info("the scheduler and worker are back (restart %d)", self._attempts)
            events.engine_restarted(self.endpoints, self.receiver)
            return True
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the scheduler to stop, then make sure both processes are gone."""
        if self._stopping:
            return
        self._stopping = True
        # the scheduler stops the worker: with a disk tier it first has the worker write the
        # pool's cached pages back, and the worker writes what is queued before it exits. Only a
        # scheduler that did not exit cleanly leaves the worker for the front to stop.
        deadline = time.monotonic() + timeout + (DISK_WRITE_BACK_S if self.config.kv_disk_dir else 0.0)
        for proc, addr in ((self.scheduler, self.endpoints.front_to_scheduler), (self.worker, self.endpoints.scheduler_to_worker)):
            if proc.is_alive() and (proc is self.scheduler or self.scheduler.exitcode != 0):
                Sender(zmq.Context.instance(), addr, bind=False).send_last(Shutdown())
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        if self._watch_thread is not None and self._watch_thread is not threading.current_thread():
            self._watch_thread.join(timeout)  # a restart in progress sees _stopping and ends
        self._kill_all()
        self.receiver.close()
        self.endpoints.remove()

    def _kill_all(self) -> None:
        for p in self.processes:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(2)


_MAIN_LOCK = threading.Lock()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start spawned children without re-running the parent's `__main__`.

    multiprocessing's spawn re-imports the parent's main script in each child (as `__mp_main__`),
    for functions pickled from it. Ours are radixserve's own, so there is nothing to find there,
    and re-running a user's script that builds an `Engine` at top level would make each child
    start an Engine of its own ("An attempt has been made to start a new process before the
    current process has finished its bootstrapping phase"). While the children start, `__main__`
    shows neither a file nor a spec, so spawn sends no main to re-import: such a script works
    as written, without an `if __name__ == "__main__":` guard.
    """
    main = sys.modules["__main__"]
    missing = object()
    with _MAIN_LOCK:
        saved = {name: main.__dict__.get(name, missing) for name in ("__file__", "__spec__")}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is missing:
                    main.__dict__.pop(name, None)
                else:
                    main.__dict__[name] = value

