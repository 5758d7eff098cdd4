"""What every benchmark (and bench/robustness/) shares: a radixserve server to measure, a free
port, the server's /metrics counters, a clock for `generate`'s steps, and the command-line
options they have in common, each defined once.

    with launch_server("default", "--dtype", "auto") as server:   # started, healthy, warmed up
        run(server.url)                                            # stopped (SIGTERM) on exit
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.config import DTYPES
from radixserve.ipc import stop_process
from radixserve.kernels import isa

if TYPE_CHECKING:
    import torch

HOST = "127.0.0.1"
LOG_TAIL = 8000  # characters of a failed server's log quoted in the error


# ---------------------------------------------------------------------- a server to measure


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the OS's pick; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m radixserve serve --model MODEL OPTIONS...` in a subprocess on a free loopback
    port, started at construction; its output goes to `log_path` (a temporary file without one,
    gone once stopped). `env` adds to this process's environment."""

    def __init__(self, model: Path | str, *options: str, log_path: Path | None = None,
                 env: dict[str, str] | None = None, host: str = HOST) -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        cmd = self.command(model, host, self.port, options)
        self._log: IO[bytes] = open(log_path, "wb") if log_path else tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env} if env else None)

    def command(self, model: Path | str, host: str, port: int, options: Sequence[str]) -> list[str]:
        """The server's command line (another server, such as llama.cpp's, overrides it)."""
        return [sys.executable, "-m", "radixserve", "serve", "--model", str(model), "--host", host,
                "--port", str(port), *options]

    def log(self) -> str:
        """What the server has printed so far."""
        if self.log_path is not None:
            return self.log_path.read_text(errors="replace")
        if self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def _log_tail(self) -> str:
        where = f" (whole log: {self.log_path})" if self.log_path else ""
        return f"{where}:\n{self.log()[-LOG_TAIL:]}"

    def wait_healthy(self, timeout: float = 180.0) -> ServerProcess:
        """Until /health answers 200; a RuntimeError if the server exits first, a TimeoutError
        after `timeout` seconds, each quoting the end of its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the server did not become healthy in {timeout} s{self._log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` (unless it has exited) and wait up to `timeout` seconds, then SIGKILL; the
        exit code (-9 where it had to be killed)."""
        code = stop_process(self.proc, sig, timeout)
        self._log.close()
        return code


@contextlib.contextmanager
def launch_server(model: Path | str, *options: str, log_path: Path | None = None, env: dict[str, str] | None = None,
                  timeout: float = 300.0, warm: bool = True, flush: bool = True,
                  stop_timeout: float = 60.0) -> Iterator[ServerProcess]:
    """A healthy server for the block, stopped (SIGTERM, then SIGKILL after `stop_timeout`) on
    exit. `warm`: a few short requests first (first-call costs: allocator, kernels), then, with
    `flush`, an empty cache; `flush` False keeps what the server found cached at start (a disk
    tier after a restart), the warm-up's own prefix too."""
    server = ServerProcess(model, *options, log_path=log_path, env=env)
    try:
        server.wait_healthy(timeout)
        if warm:
            warm_up(server.url, flush)
        yield server
    finally:
        server.stop(timeout=stop_timeout)


def warm_up(url: str, flush: bool = True) -> None:
    """A few short requests (first-call costs: allocator, kernels), then an empty cache."""
    body = {"text": "Warm-up: count from one to ten.", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    for _ in range(2):
        httpx.post(url + "/generate", json=body, timeout=120).raise_for_status()
    if flush:
        flush_cache(url)


def flush_cache(url: str) -> None:
    resp = httpx.post(url + "/flush_cache", timeout=60)
    if resp.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {resp.status_code}: {resp.text}")


# ---------------------------------------------------------------------- /metrics


def metric_totals(metrics_text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named sample of a Prometheus /metrics text (`radixserve_..._total`, say), summed
    over its labels; a name with no sample at all is a KeyError naming it."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in names:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    missing = [name for name in names if name not in totals]
    if missing:
        raise KeyError(f"/metrics has no sample named {', '.join(missing)}")
    return totals


def read_metric_totals(url: str, names: Sequence[str]) -> dict[str, float]:
    """`metric_totals` of the server's /metrics now; an HTTP error status raises."""
    resp = httpx.get(url + "/metrics", timeout=30)
    resp.raise_for_status()
    return metric_totals(resp.text, names)


# ---------------------------------------------------------------------- timing


class StepClock:
    """A logits processor for `generate` that only records when each step's logits were ready
    (on CUDA, once the device has finished the step's work) and passes them on unchanged."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.times: list[float] = []
        self._cuda = device if device is not None and device.type == "cuda" else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._cuda is not None:
            import torch

            torch.cuda.synchronize(self._cuda)
        self.times.append(time.perf_counter())
        return scores


# ---------------------------------------------------------------------- options


def new_parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """A parser whose --help shows `doc` (a module docstring) as written."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(parser: argparse.ArgumentParser, default: str = "default", help: str | None = None,  # noqa: A002
              dtype: bool = True, dtype_help: str | None = None) -> None:
    """`--model` and, with `dtype`, `--dtype` (`add_dtype`)."""
    parser.add_argument("--model", default=default,
                        help=help or "a model name radixserve resolves (`default`) or a Hugging Face folder")
    if dtype:
        add_dtype(parser, help=dtype_help)


def add_dtype(parser: argparse.ArgumentParser, choices: Sequence[str] = DTYPES, help: str | None = None) -> None:  # noqa: A002
    """`--dtype`, `auto` by default: what `radixserve serve --dtype auto` picks (bf16 on CUDA and
    on CPUs from the avx2 ISA tier up, fp32 elsewhere); `resolved_dtype` names it."""
    parser.add_argument("--dtype", default="auto", choices=list(choices),
                        help=help or "the model's dtype; auto: bf16 on CUDA and avx2+ CPUs, else fp32")


def add_page_size(parser: argparse.ArgumentParser, default: int = 16) -> None:
    parser.add_argument("--page-size", type=int, default=default, help="tokens per KV page")


def add_isa(parser: argparse.ArgumentParser) -> None:
    """--isa: the CPU ISA tier an in-process benchmark runs at (`apply_isa`)."""
    parser.add_argument("--isa", choices=[str(t) for t in isa.Tier], help="the ISA tier to run at (default: the machine's)")


def apply_isa(args: argparse.Namespace) -> None:
    """Select --isa's tier (if given) before torch's first matmul: the tier caps torch's kernels
    too, and is fixed once chosen."""
    if args.isa:
        os.environ[isa.OVERRIDE_ENV] = args.isa
    isa.selected_tier()


def add_documents(parser: argparse.ArgumentParser, docs: int, doc_tokens: int, questions: int) -> None:
    """The shared-prefix workload's shape: `--docs` documents of about `--doc-tokens` tokens,
    `--questions` questions on each."""
    parser.add_argument("--docs", type=int, default=docs)
    parser.add_argument("--doc-tokens", type=int, default=doc_tokens)
    parser.add_argument("--questions", type=int, default=questions, help="questions per document")


def add_server_arg(parser: argparse.ArgumentParser, help: str = "more `serve` options (repeatable)") -> None:  # noqa: A002
    parser.add_argument("--server-arg", action="append", default=[], help=help)


def add_load(parser: argparse.ArgumentParser, concurrency: int = 16) -> None:
    """`--concurrency` (requests in flight) and `--seed` (the workload's draw)."""
    parser.add_argument("--concurrency", type=int, default=concurrency)
    parser.add_argument("--seed", type=int, default=0)


def add_out(parser: argparse.ArgumentParser, default: Path | str, help: str | None = None) -> None:  # noqa: A002
    parser.add_argument("--out", type=Path, default=Path(default), help=help)


def resolved_dtype(name: str, device: str = "cpu") -> str:
    """The dtype `--dtype name` runs at on `device`: `auto` resolved as the server resolves it."""
    import torch

    from radixserve.worker.device import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(name, torch.device(device)))


def torch_dtype(name: str, device: str = "cpu") -> Any:
    """`resolved_dtype` as a torch.dtype."""
    import torch

    return getattr(torch, resolved_dtype(name, device))
