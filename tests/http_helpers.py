"""Starting the real HTTP server as a subprocess on a free loopback port (bench/common.py's
launcher, the benchmarks' own), and reading its answers."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import pid_alive

from bench.common import HOST, ServerProcess
from bench.common import free_port as free_port  # tests take it from here

# fast, exact settings for the tiny model; tests add their own options after these
TINY_OPTIONS = ("--dtype", "float32", "--page-size", "4", "--kv-pages", "1024", "--chunk-size", "64")


class Server(ServerProcess):
    """`python -m radixserve serve` in a subprocess (bench.common.ServerProcess: started at
    construction, `wait_healthy`, `log`, `stop`), with what tests ask of a running server."""

    def info(self, **headers: str) -> dict[str, Any]:
        return httpx.get(self.url + "/server_info", headers=headers, timeout=30).json()

    def wait_idle(self, timeout: float = 20.0, **headers: str) -> dict[str, Any]:
        """Wait until nothing runs or waits; returns /server_info then."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info(**headers)
            if info["requests"] == {"running": 0, "waiting": 0}:
                return info
            assert time.monotonic() < deadline, f"requests still running: {info}"
            time.sleep(0.1)


@contextmanager
def running_server(model: Path | str, *options: str, log_dir: Path) -> Iterator[Server]:
    """A healthy server for the block; afterwards it must stop cleanly (exit code 0), else the
    assertion shows its log. The body of every module-scoped `server` fixture."""
    srv = Server(model, *options, log_path=log_dir / "server.log")
    try:
        yield srv.wait_healthy()
    finally:
        assert srv.stop() == 0, srv.log()


def assert_pages_balanced(info: dict[str, Any]) -> None:
    """Every page is free or cached: nothing left held by a finished or aborted request."""
    pages = info["pages"]
    assert pages["in_use"] == 0, pages
    assert pages["free"] + pages["cached"] == pages["total"] and pages["evictable"] == pages["cached"], pages


def sse_events(lines: list[str]) -> tuple[list[Any], bool]:
    """The JSON payloads of an SSE body's `data:` lines, and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            assert not done, "an event after [DONE]"
            events.append(json.loads(data))
    return events, done


def metric_samples(text: str, model_name: str | None = None) -> dict[str, float]:
    """The radixserve_* samples of a /metrics text, keyed `name` or `name{label="value",...}`
    (labels sorted, as the server prints them) without the `model_name` label, which every
    sample must carry (equal to `model_name` when given)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("radixserve_"):
                continue
            labels = dict(sample.labels)
            got = labels.pop("model_name", None)
            assert got is not None, f"{sample.name} has no model_name label"
            assert model_name is None or got == model_name, (sample.name, got, model_name)
            rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[sample.name + (f"{{{rest}}}" if rest else "")] = sample.value
    return out


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still alive after waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def raw_request(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> socket.socket:
    """Send a POST over a raw socket and return the socket, so a test can hang up mid-answer."""
    sock = socket.create_connection((HOST, port))
    head = [f"POST {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock
