"""Where a server's processes run on the CPU: the worker's cores and threads, and the cores left
to the scheduler and the front.

Replicas that share a machine (docs/deploy.md) must not fight over cores: a worker's forward
uses every thread it has, and two workers whose OpenMP pools float over the same cores slow
each other down far more than their share. `--cpu-affinity LIST` pins the worker (every thread
of it, so its torch, oneDNN and OpenMP pools inherit the mask) and `--num-threads N` sizes its
pools; the scheduler and the front (mostly waiting on sockets, but they tokenize and poll) go to
the cores this server may use that the worker does not, when there are any.

Only the worker process and the server process (before it starts its children) call the
`pin_*` functions; the parent decides, with `plan`, so the ready log and /server_info can show
the decision without asking the worker.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("radixserve")

# the thread pools a CPU forward can use: torch's and oneDNN's (OpenMP), our C kernels (OpenMP,
# sized per call from torch.get_num_threads()), and MKL / OpenBLAS where torch was built with them
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
MAX_CPU_LIST_CHARS = 4096


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,8,10-11` (the kernel's cpulist syntax, as taskset -c takes it) -> sorted unique cores.
    Raises ValueError naming what is wrong, so a typo fails at start-up, not as a slow server."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("cpu_affinity must be a list of cores like '0-3' or '0,2,4-7', got an empty value")
    if len(text) > MAX_CPU_LIST_CHARS:
        raise ValueError(f"cpu_affinity is longer than {MAX_CPU_LIST_CHARS} characters")
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not _is_index(low) or (dash and not _is_index(high)):
            raise ValueError(f"cpu_affinity {text!r}: {part!r} is not a core number or a range like 4-7")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"cpu_affinity {text!r}: the range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def _is_index(s: str) -> bool:
    return s.isascii() and s.isdigit() and len(s) <= 6


def format_cpu_list(cores: tuple[int, ...] | list[int] | set[int] | frozenset[int]) -> str:
    """The inverse of `parse_cpu_list`, with runs folded: (0, 1, 2, 5) -> '0-2,5'."""
    out: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def usable_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Placement:
    """The decision for one server. `None` everywhere means: as before, nothing pinned."""

    worker_cpus: tuple[int, ...] | None  # the worker's cores; None: not pinned
    worker_threads: int | None  # the worker's pool size; None: torch's default
    service_cpus: tuple[int, ...] | None  # scheduler and front; None: not pinned (no spare core)

    def describe(self) -> str:
        """One phrase for the ready log line."""
        threads = "torch's default threads" if self.worker_threads is None else f"{self.worker_threads} threads"
        cores = "any core" if self.worker_cpus is None else f"cores {format_cpu_list(self.worker_cpus)}"
        if self.service_cpus is not None:
            service = f"scheduler and front on cores {format_cpu_list(self.service_cpus)}"
        elif self.worker_cpus is not None:
            service = "scheduler and front share the worker's cores (no other core is free)"
        else:
            service = "scheduler and front on any core"
        return f"worker: {threads} on {cores}; {service}"

    def to_dict(self) -> dict[str, object]:
        """For /server_info: core lists in the cpulist syntax."""
        return {
            "worker_threads": self.worker_threads,
            "worker_cpus": None if self.worker_cpus is None else format_cpu_list(self.worker_cpus),
            "service_cpus": None if self.service_cpus is None else format_cpu_list(self.service_cpus),
        }


def plan(num_threads: int | None, cpu_affinity: str | None, usable: tuple[int, ...] | None = None) -> Placement:
    """Decide where the worker and the rest go. `cpu_affinity` must name cores this process may
    use (else ValueError: pinning to a core outside a container's cpuset fails at the OS anyway,
    later and less clearly). With cores but no thread count, one thread per core."""
    if cpu_affinity is None:
        return Placement(None, num_threads, None)
    usable = usable_cpus() if usable is None else usable
    cores = parse_cpu_list(cpu_affinity)
    outside = sorted(set(cores) - set(usable))
    if outside:
        raise ValueError(
            f"cpu_affinity {cpu_affinity!r} names core(s) {format_cpu_list(outside)} that this process "
            f"may not use; usable cores: {format_cpu_list(usable)}"
        )
    rest = tuple(c for c in usable if c not in cores)
    return Placement(cores, num_threads or len(cores), rest or None)


def start_pinned(process: Any, cores: tuple[int, ...] | None) -> None:
    """`process.start()` with the child confined to `cores`: a spawned child inherits the mask
    of the thread that starts it, so only this thread is pinned, and only for the call (the
    caller, an Engine user's program for one, stays where it was)."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        process.start()
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        process.start()
    finally:
        os.sched_setaffinity(0, before)


def thread_env(threads: int) -> dict[str, str]:
    """The environment that sizes every OpenMP/BLAS pool of a process to `threads`."""
    return {name: str(threads) for name in THREAD_ENV}


def pin_current_process(cores: tuple[int, ...]) -> None:
    """Set the affinity of every thread of this process (sched_setaffinity(0) alone moves only
    the calling thread; pools started earlier would stay where they were)."""
    if not hasattr(os, "sched_setaffinity"):
        log.warning("this platform cannot pin processes to cores; cpu_affinity is ignored")
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def pin_worker(placement: Placement) -> None:
    """In the worker process, before torch is imported: pin it and size its thread pools (the
    environment is read once, when an OpenMP runtime loads; torch.set_num_threads follows in
    `size_torch_threads`, for a torch that was imported already)."""
    if placement.worker_cpus is not None:
        pin_current_process(placement.worker_cpus)
    if placement.worker_threads is not None:
        os.environ.update(thread_env(placement.worker_threads))


def size_torch_threads(placement: Placement) -> int:
    """Apply the thread count to torch (our C kernels take torch.get_num_threads() per call);
    returns the count in use."""
    import torch

    if placement.worker_threads is not None:
        torch.set_num_threads(placement.worker_threads)
    return torch.get_num_threads()
