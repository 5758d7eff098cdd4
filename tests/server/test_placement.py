"""CPU placement options (--num-threads, --cpu-affinity, --device cuda:K): parsing, validation,
the plan, the pinning a real server applies to its three processes, and its worker giving up
the thread of a core another process keeps busy (--disable-adaptive-threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from http_helpers import TINY_OPTIONS, running_server

from radixserve.config import ServerConfig
from radixserve.placement import (
    Placement,
    format_cpu_list,
    parse_cpu_list,
    plan,
    thread_env,
    usable_cpus,
)

CAN_PIN = hasattr(os, "sched_setaffinity")


@pytest.mark.parametrize(("text", "cores"), [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0,2,4-7", (0, 2, 4, 5, 6, 7)), ("3,1,1-2", (1, 2, 3)),
    (" 0 , 2 ", (0, 2)), ("5-5", (5,)),
])
def test_parse_cpu_list(text, cores):
    assert parse_cpu_list(text) == cores
    assert parse_cpu_list(format_cpu_list(cores)) == cores


@pytest.mark.parametrize(("text", "says"), [
    ("", "empty"), ("   ", "empty"), ("a", "not a core number"), ("0-", "not a core number"),
    ("-1", "not a core number"), ("1,,2", "not a core number"), ("3-1", "backwards"), ("0x1", "not a core number"),
    ("1.5", "not a core number"), ("٣", "not a core number"), ("1" * 7, "not a core number"), ("0," * 3000, "longer"),
])
def test_parse_cpu_list_refuses_with_a_clear_message(text, says):
    with pytest.raises(ValueError, match=says):
        parse_cpu_list(text)


def test_format_cpu_list_folds_runs():
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list(set()) == ""


def test_plan():
    usable = (0, 1, 2, 3, 4, 5, 6, 7)
    assert plan(None, None, usable) == Placement(None, None, None)  # nothing asked: nothing pinned
    assert plan(3, None, usable) == Placement(None, 3, None)
    assert plan(None, "0-3", usable) == Placement((0, 1, 2, 3), 4, (4, 5, 6, 7))  # one thread per core
    assert plan(2, "4-7", usable) == Placement((4, 5, 6, 7), 2, (0, 1, 2, 3))
    assert plan(None, "0-7", usable) == Placement(tuple(usable), 8, None)  # no spare core for the rest
    with pytest.raises(ValueError, match=r"core\(s\) 8-9 that this process may not use; usable cores: 0-7"):
        plan(None, "6-9", usable)


def test_describe_and_to_dict():
    p = Placement((0, 1, 2, 3), 4, (4, 5))
    assert p.describe() == "worker: 4 threads on cores 0-3; scheduler and front on cores 4-5"
    assert p.to_dict() == {"worker_threads": 4, "worker_cpus": "0-3", "service_cpus": "4-5"}
    assert "torch's default threads on any core" in Placement(None, None, None).describe()
    assert "share the worker's cores" in Placement((0,), 1, None).describe()


def test_thread_env_sizes_every_pool():
    assert thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}


def test_config_validates_options():
    first = usable_cpus()[0]
    assert ServerConfig(cpu_affinity=str(first), num_threads=2).cpu_affinity == str(first)
    for bad, says in [
        (dict(num_threads=0), "num_threads must be an integer >= 1"),
        (dict(num_threads=True), "num_threads must be an integer >= 1"),
        (dict(cpu_affinity="0-"), "not a core number"),
        (dict(cpu_affinity=str(max(usable_cpus()) + 1)), "may not use"),
        (dict(device="cuda:x"), "cuda:K"),
        (dict(device="gpu"), "cuda:K"),
    ]:
        with pytest.raises(ValueError, match=says):
            ServerConfig(**bad)
    assert ServerConfig(device="cuda:1").device == "cuda:1"  # whether GPU 1 exists is the worker's check


def test_cli_refuses_a_bad_list_before_loading_anything():
    out = subprocess.run(
        [sys.executable, "-m", "radixserve", "serve", "--model", "no-such-model", "--cpu-affinity", "0-3,x"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "cpu_affinity '0-3,x': 'x' is not a core number" in out.stderr, out.stderr


def test_cuda_device_index_is_checked_by_the_worker():
    from radixserve.worker.device import resolve_device

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            resolve_device("cuda:0")
        return
    count = torch.cuda.device_count()
    assert resolve_device(f"cuda:{count - 1}").index == count - 1
    with pytest.raises(ValueError, match=f"sees {count} CUDA device"):
        resolve_device(f"cuda:{count}")


@pytest.mark.gpu
def test_server_on_the_last_gpu(tiny_dir, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    last = torch.cuda.device_count() - 1
    with running_server(tiny_dir, *TINY_OPTIONS, "--device", f"cuda:{last}", log_dir=tmp_path) as server:
        info = server.info()
        assert info["model"]["device"] == f"cuda:{last}"
        import httpx

        r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def _affinity(pid: int) -> set[int]:
    """The cores every thread of a process may run on (the union; each must equal it)."""
    masks = {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}
    assert len(masks) == 1, f"threads of {pid} disagree: {masks}"
    return set(next(iter(masks)))


@pytest.mark.skipif(not CAN_PIN or len(usable_cpus()) < 2, reason="needs Linux affinity and 2 usable cores")
def test_server_pins_worker_and_keeps_the_rest_off_its_cores(tiny_dir: Path, tmp_path: Path):
    cores = usable_cpus()
    worker_core, rest = cores[-1], set(cores[:-1])
    with running_server(tiny_dir, *TINY_OPTIONS, "--cpu-affinity", str(worker_core), log_dir=tmp_path) as server:
        info = server.info()
        assert info["placement"] == {
            "worker_threads": 1, "worker_cpus": str(worker_core), "service_cpus": format_cpu_list(rest),
        }
        pids = info["pids"]
        assert _affinity(pids["worker"]) == {worker_core}
        assert _affinity(pids["scheduler"]) == rest
        assert _affinity(pids["server"]) == rest
        log = server.log()
        assert f"worker: 1 threads on cores {worker_core}; scheduler and front on cores {format_cpu_list(rest)}" in log
        assert f"worker threads: 1; cores: {worker_core}" in log  # the worker's own account, after pinning


def _worker_threads(url: str) -> float | None:
    """radixserve_worker_threads from /metrics (None before the first forward's report)."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("radixserve_worker_threads{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _generate_until(url: str, wanted: float, seconds: float) -> float | None:
    """Keeps the worker decoding until radixserve_worker_threads reads `wanted` (or time is up);
    returns the last reading."""
    body = {"text": "The governor counts", "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
    deadline = time.monotonic() + seconds
    threads = None
    while time.monotonic() < deadline:
        httpx.post(url + "/generate", json=body, timeout=60).raise_for_status()
        threads = _worker_threads(url)
        if threads == wanted:
            break
    return threads


GOVERNED = pytest.mark.skipif(
    not CAN_PIN or len(usable_cpus()) < 2 or not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
    reason="needs Linux affinity, per-thread schedstat and 2 usable cores")


@contextmanager
def _busy_core(core: int) -> Iterator[None]:
    """A process that keeps `core` busy for the block."""
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


@GOVERNED
def test_a_busy_core_takes_a_thread_from_the_worker_until_it_is_free(default_model_dir: Path, tmp_path: Path):
    """A process that keeps one of the worker's two cores busy makes it give up a thread, and
    it takes the thread back once the core is free (worker/thread_governor.py)."""
    cores = usable_cpus()[:2]
    with running_server(default_model_dir, "--cpu-affinity", format_cpu_list(cores), log_dir=tmp_path) as server:
        with _busy_core(cores[1]):
            assert _generate_until(server.url, 1, 60) == 1
        assert _generate_until(server.url, 2, 60) == 2


@GOVERNED
def test_adaptive_threads_off_keeps_every_thread_beside_a_busy_core(default_model_dir: Path, tmp_path: Path):
    cores = usable_cpus()[:2]
    with running_server(default_model_dir, "--cpu-affinity", format_cpu_list(cores), "--disable-adaptive-threads",
                        log_dir=tmp_path) as server:
        with _busy_core(cores[1]):
            assert _generate_until(server.url, 1, 5) == 2
