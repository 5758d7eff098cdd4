"""Starting and stopping the scheduler and worker processes, and watching them."""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import zmq

from radixserve.config import ServerConfig
from radixserve.ipc import Endpoints, Sender
from radixserve.kernels import isa
from radixserve.placement import Placement, plan, start_pinned
from radixserve.protocol import SchedulerReady, Shutdown
from radixserve.scheduler.process import run_scheduler
from radixserve.worker.process import run_worker

log = logging.getLogger("radixserve")


class StartupError(RuntimeError):
    pass


class Backend:
    """The scheduler and worker processes of one server instance, and their private sockets.

    The caller binds the scheduler->front socket first (`receiver`), so no output is ever lost.
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
        self.endpoints = Endpoints.create()
        self.receiver = zmq.Context.instance().socket(zmq.PULL)
        self.receiver.setsockopt(zmq.LINGER, 0)
        self.receiver.bind(self.endpoints.scheduler_to_front)
        ctx = mp.get_context("spawn")  # no fork: torch and zmq state must not be inherited
        self.worker = ctx.Process(target=run_worker, args=(config, self.endpoints, self.placement), name="radixserve-worker", daemon=True)
        self.scheduler = ctx.Process(target=run_scheduler, args=(config, self.endpoints), name="radixserve-scheduler", daemon=True)
        self._stopping = False
        self._watch_thread: threading.Thread | None = None

    @property
    def processes(self) -> list[mp.process.BaseProcess]:
        return [self.scheduler, self.worker]

    def start(self) -> SchedulerReady:
        """Start both processes and wait until the model is loaded. Raises StartupError."""
        with _main_module_hidden():
            self.worker.start()  # pins itself (run_worker), every thread, before torch loads
            start_pinned(self.scheduler, self.placement.service_cpus)
        deadline = time.monotonic() + self.config.startup_timeout
        decoder = msgspec.msgpack.Decoder(SchedulerReady)
        while time.monotonic() < deadline:
            if self.receiver.poll(200):
                return decoder.decode(self.receiver.recv())
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                self.stop()
                raise StartupError(
                    f"{dead[0].name} exited with code {dead[0].exitcode} during start-up; see its log above"
                )
        self.stop()
        raise StartupError(f"the model did not load within {self.config.startup_timeout:.0f} s")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` once if either process dies, and stop the other one."""

        def loop() -> None:
            while not self._stopping:
                for p in self.processes:
                    if not p.is_alive():
                        if self._stopping:
                            return
                        reason = f"the {p.name.split('-')[-1]} process died (exit code {p.exitcode})"
                        log.error("%s; failing in-flight requests", reason)
                        on_death(reason)
                        self._kill_all()
                        return
                time.sleep(0.1)

        self._watch_thread = threading.Thread(target=loop, name="radixserve-watchdog", daemon=True)
        self._watch_thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the scheduler to stop, then make sure both processes are gone."""
        if self._stopping:
            return
        self._stopping = True
        for proc, addr in ((self.scheduler, self.endpoints.front_to_scheduler), (self.worker, self.endpoints.scheduler_to_worker)):
            if proc.is_alive():
                sender = Sender(zmq.Context.instance(), addr, bind=False)
                sender.send(Shutdown())
                sender.socket.close(linger=1000)  # LINGER 0 would drop the message unsent
        deadline = time.monotonic() + timeout
        for p in self.processes:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
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

