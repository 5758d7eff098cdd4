"""ZeroMQ plumbing: private ipc endpoints, typed msgpack channels, and child-process hygiene."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import setproctitle
import zmq

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoints:
    """The four one-way channels between front, scheduler and worker, in a 0700 directory."""

    directory: str

    @classmethod
    def create(cls) -> Endpoints:
        # mkdtemp creates the directory with mode 0700: only this user can reach the sockets
        return cls(tempfile.mkdtemp(prefix="radixserve-"))

    def _addr(self, name: str) -> str:
        return f"ipc://{self.directory}/{name}"

    @property
    def front_to_scheduler(self) -> str:
        return self._addr("front-to-scheduler")

    @property
    def scheduler_to_front(self) -> str:
        return self._addr("scheduler-to-front")

    @property
    def scheduler_to_worker(self) -> str:
        return self._addr("scheduler-to-worker")

    @property
    def worker_to_scheduler(self) -> str:
        return self._addr("worker-to-scheduler")

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class Sender:
    """PUSH side of a channel: encodes msgspec Structs as msgpack. No pickle, ever."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(addr)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: msgspec.Struct) -> None:
        self.socket.send(self._encoder.encode(msg), copy=False)

    def send_last(self, msg: msgspec.Struct) -> None:
        """Send `msg`, then close the socket, leaving it up to a second to go out: with the
        channel's LINGER 0, a process that exits (or a socket closed) right after a send would
        drop the message unsent."""
        self.send(msg)
        self.socket.close(linger=1000)


class Receiver(Generic[T]):
    """PULL side of a channel: decodes only the message types of its channel."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool, msg_type: Any) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(addr)
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """The next message, or None if none came within `timeout_ms` (None: wait forever)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self._decoder.decode(self.socket.recv(copy=False).buffer)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)


def die_with_parent(watch: bool = True) -> None:
    """Make this child process exit when the process that started it goes away.

    PR_SET_PDEATHSIG covers a parent killed with SIGKILL on Linux; the watcher thread covers
    everything else (and other platforms) by noticing that we were re-parented. A process that
    forks (the grammar compile process) goes without the thread (`watch=False`): a fork of a
    process with threads is unsafe.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watcher() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    if watch:
        threading.Thread(target=watcher, name="parent-watch", daemon=True).start()


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Send `sig` to a child (unless it has exited) and wait up to `timeout` seconds for it, then
    SIGKILL it; its exit code (-9 where it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_child(log_level: str, title: str) -> zmq.Context:
    """Common start of the scheduler and worker processes; returns their ZMQ context.

    Children die with their parent and leave Ctrl-C to it (the parent shuts them down in order).
    Each names itself (`radixserve::scheduler`, `radixserve::worker`, as SGLang's
    `sglang::scheduler`): spawned children are otherwise indistinguishable Python processes in
    `ps` and `top`.
    """
    setproctitle.setproctitle(title)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return zmq.Context()


def socket_dir_is_private(path: str) -> bool:
    return (Path(path).stat().st_mode & 0o777) == 0o700
