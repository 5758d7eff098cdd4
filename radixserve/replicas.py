"""N radixserve replicas on one machine, each pinned to its own cores, behind SGLang's router.

    python -m radixserve.replicas --replicas 2 --model default --port 30000   # or: make serve-replicas N=2

The router (`pip install 'radixserve[router]'`, sglang-router 0.3.2) listens on `--port`; replica
i listens on `--port + 1 + i`. Each replica's worker gets `--threads-per-replica` cores of its
own (default: the usable cores split evenly); cores left over go to every replica's scheduler and
front, else those float over the machine. Ctrl-C stops the router and every replica.

This is the one-machine example of docs/deploy.md, and what tests/server/test_router.py and
bench/router.py start: replicas and router are plain subprocesses with the command lines an
operator would type, so what they test is what a deployment runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import httpx

from radixserve.ipc import stop_process
from radixserve.placement import format_cpu_list, usable_cpus

ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_VERSION = "0.3.2"  # the version docs/deploy.md and the tests were checked against
# The router's defaults react to a dead replica in minutes (a health check every 60 s, three
# failures to mark it down), and its circuit breaker opens after 10 consecutive failures, which in
# 0.3.2 include a replica's 4xx answers to bad requests. These make a killed replica drop out in
# about 10 s, and a request sent to it meanwhile is retried elsewhere once the breaker opens
# (retries > threshold), while a burst of client errors closes a replica for 10 s, not 60.
ROUTER_DEFAULTS: tuple[str, ...] = (
    "--health-check-interval-secs", "5", "--health-failure-threshold", "2",
    "--retry-max-retries", "6", "--cb-failure-threshold", "5", "--cb-timeout-duration-secs", "10",
)
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def router_available() -> bool:
    """Whether sglang-router is installed (it is an extra: `pip install 'radixserve[router]'`)."""
    return importlib.util.find_spec("sglang_router") is not None


def split_cores(replicas: int, threads: int | None = None,
                cores: Sequence[int] | None = None) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Each replica's worker cores (consecutive, `threads` each; default: an even split), and the
    cores left over for the schedulers and fronts. ValueError when the cores do not suffice."""
    cores = tuple(usable_cpus() if cores is None else cores)
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    per = threads if threads is not None else len(cores) // replicas
    if per < 1 or per * replicas > len(cores):
        raise ValueError(
            f"{replicas} replica(s) x {threads or 'an even share of'} thread(s) need more cores than "
            f"the {len(cores)} usable here ({format_cpu_list(cores)})"
        )
    slices = [cores[i * per:(i + 1) * per] for i in range(replicas)]
    return slices, cores[per * replicas:]


def _child_setup(allowed: tuple[int, ...] | None) -> None:
    """In a replica or router child, between fork and exec: die with the launcher (SIGTERM, so a
    replica still stops its own children), and keep to `allowed` cores if given."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if allowed is not None:
        os.sched_setaffinity(0, allowed)


class _Process:
    """One child with its log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], log_path: Path | None, allowed: tuple[int, ...] | None = None) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self._log: IO[bytes] | None = open(log_path, "wb") if log_path else None  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
            preexec_fn=lambda: _child_setup(allowed),  # noqa: PLW1509 - no threads run in the child before exec
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
        code = stop_process(self.proc, sig, timeout)
        if self._log:
            self._log.close()
            self._log = None
        return code


def _wait_until(check: Callable[[], bool], what: str, proc: _Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with code {proc.proc.returncode} while {what}:\n{proc.log()[-4000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{proc.name}: not {what} after {timeout:.0f} s:\n{proc.log()[-4000:]}")


class Replica(_Process):
    """`radixserve serve` pinned to its cores."""

    def __init__(self, index: int, model: str, port: int, cores: tuple[int, ...], spare: tuple[int, ...],
                 options: Sequence[str], host: str, log_dir: Path | None) -> None:
        self.url = f"http://{host}:{port}"
        self.cores = cores
        cmd = [sys.executable, "-m", "radixserve", "serve", "--model", model, "--host", host, "--port", str(port),
               "--cpu-affinity", format_cpu_list(cores), "--num-threads", str(len(cores)), *options]
        # with spare cores, the replica may use only its own and those: its scheduler and front
        # then stay off every other replica's worker (radixserve/placement.py plans from the mask)
        allowed = cores + spare if spare else None
        super().__init__(f"replica {index} ({self.url})", cmd, log_dir / f"replica{index}.log" if log_dir else None, allowed)

    def wait_healthy(self, timeout: float, headers: dict[str, str] | None = None) -> None:
        _wait_until(lambda: httpx.get(self.url + "/health", headers=headers, timeout=5).status_code == 200,
                    "healthy", self, timeout)


class Router(_Process):
    """SGLang's router (`python -m sglang_router.launch_router`) in front of `worker_urls`."""

    def __init__(self, worker_urls: Sequence[str], port: int, *, policy: str = "cache_aware", host: str = "127.0.0.1",
                 prometheus_port: int | None = None, api_key: str | None = None, log_level: str = "warn",
                 extra: Sequence[str] = (), log_path: Path | None = None) -> None:
        if not router_available():
            raise RuntimeError(f"sglang-router is not installed: pip install 'radixserve[router]' (sglang-router=={ROUTER_VERSION})")
        self.url = f"http://{host}:{port}"
        self.num_workers = len(worker_urls)
        self.api_key = api_key
        self.prometheus_port = prometheus_port or port + 1000
        cmd = [sys.executable, "-m", ROUTER_MODULE, "--worker-urls", *worker_urls, "--policy", policy,
               "--host", host, "--port", str(port), "--prometheus-host", host,
               "--prometheus-port", str(self.prometheus_port), "--log-level", log_level, *ROUTER_DEFAULTS, *extra]
        if api_key:
            cmd += ["--api-key", api_key]  # the router's own key, which it also sends to the workers
        super().__init__(f"router ({self.url}, {policy})", cmd, log_path)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def healthy_workers(self) -> int:
        return int(httpx.get(self.url + "/readiness", headers=self.headers, timeout=5).json().get("healthy_workers", 0))

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every worker is registered and healthy (the router adds them in the background)."""
        _wait_until(lambda: self.healthy_workers() == self.num_workers, f"routing to {self.num_workers} workers",
                    self, timeout)


@contextlib.contextmanager
def serve_replicas(model: str, replicas: int, port: int, *, policy: str = "cache_aware",
                   threads_per_replica: int | None = None, options: Sequence[str] = (), host: str = "127.0.0.1",
                   api_key: str | None = None, router_args: Sequence[str] = (), log_dir: Path | None = None,
                   startup_timeout: float = 600.0) -> Iterator[tuple[list[Replica], Router]]:
    """Start the replicas (in parallel: each loads the model on its own cores), wait until they
    are healthy, start the router, wait until it routes to all; stop everything on exit."""
    slices, spare = split_cores(replicas, threads_per_replica)
    key_options = ("--api-key", api_key) if api_key else ()
    started: list[_Process] = []
    try:
        group = [Replica(i, model, port + 1 + i, slices[i], spare, [*options, *key_options], host, log_dir)
                 for i in range(replicas)]
        started += group
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        for r in group:
            r.wait_healthy(startup_timeout, headers)
        router = Router([r.url for r in group], port, policy=policy, host=host, api_key=api_key, extra=router_args,
                        log_path=log_dir / "router.log" if log_dir else None)
        started.append(router)
        router.wait_ready()
        yield group, router
    finally:
        for p in reversed(started):  # the router first: nothing new reaches a stopping replica
            p.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.replicas", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--replicas", "-n", type=int, default=2, help="replicas to start")
    parser.add_argument("--model", default="default", help="the model every replica serves")
    parser.add_argument("--port", type=int, default=30000, help="the router's port; replica i gets port + 1 + i")
    parser.add_argument("--host", default="127.0.0.1", help="address of the router and the replicas")
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES, help="the router's policy")
    parser.add_argument("--threads-per-replica", type=int, default=None,
                        help="cores (and threads) of each replica's worker; default: the usable cores split evenly")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                        help="one key for the router and every replica (default: $RADIXSERVE_API_KEY)")
    parser.add_argument("--log-dir", type=Path, default=None, help="replica and router logs (default: a new temporary folder)")
    parser.add_argument("serve_options", nargs=argparse.REMAINDER,
                        help="after --: more `radixserve serve` options for every replica")
    args = parser.parse_args(argv)
    options = [o for o in args.serve_options if o != "--"]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="radixserve-replicas-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        slices, spare = split_cores(args.replicas, args.threads_per_replica)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"starting {args.replicas} replica(s) of {args.model}: worker cores "
          + ", ".join(format_cpu_list(s) for s in slices)
          + (f"; schedulers and fronts on {format_cpu_list(spare)}" if spare else "")
          + f"; logs in {log_dir}", flush=True)
    try:
        with serve_replicas(args.model, args.replicas, args.port, policy=args.policy, host=args.host,
                            threads_per_replica=args.threads_per_replica, options=options, api_key=args.api_key,
                            log_dir=log_dir) as (group, router):
            print(f"router ({args.policy}) at {router.url} -> " + " ".join(r.url for r in group)
                  + f"; router metrics at http://{args.host}:{router.prometheus_port}/metrics; Ctrl-C stops all",
                  flush=True)
            reported: set[str] = set()
            while router.alive():  # a dead replica is the router's to route around, not a reason to stop
                for r in group:
                    if not r.alive() and r.name not in reported:
                        reported.add(r.name)
                        print(f"{r.name} exited with code {r.proc.returncode}; the router routes around it "
                              f"(see {r.log_path})", file=sys.stderr, flush=True)
                time.sleep(0.5)
            print(f"the router exited with code {router.proc.returncode}; stopping the replicas", file=sys.stderr, flush=True)
            return 1
    except KeyboardInterrupt:
        print("stopping the router and the replicas", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"radixserve.replicas: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
