"""The server process: clean exit on SIGINT/SIGTERM (draining in-flight requests, no orphans),
a hung or killed worker turns /health red and fails requests instead of hanging them, the API
key, a full queue, and the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from http_helpers import (
    HOST,
    TINY_OPTIONS,
    Server,
    assert_pages_balanced,
    raw_request,
    sse_events,
    wait_gone,
)
from runtime_helpers import children_of

from radixserve.__main__ import HELP, build_parser, config_from_args
from radixserve.config import ServerConfig

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


def _start(tiny_dir, tmp_path, *options: str, env: dict[str, str] | None = None) -> Server:
    return Server(tiny_dir, *TINY_OPTIONS, *options, log_path=tmp_path / "server.log", env=env).wait_healthy()


def _stream_in_thread(url: str, body: dict, headers: dict | None = None) -> tuple[threading.Thread, dict]:
    """POST a streaming /generate in a thread; the result dict gets status, events, done."""
    result: dict = {"events": []}

    def run() -> None:
        with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, headers=headers, timeout=60) as r:
            result["status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    result["events"].append(json.loads(line[6:]))
            result["events"], result["done"] = sse_events(lines)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_in_flight_requests_and_exits_without_orphans(tiny_dir, tmp_path, sig):
    server = _start(tiny_dir, tmp_path, "--shutdown-timeout", "30")
    pids = server.info()["pids"]
    children = children_of(server.proc.pid)
    assert {pids["scheduler"], pids["worker"]} <= set(children)
    # the children name themselves, for ps and top
    titles = {role: Path(f"/proc/{pids[role]}/cmdline").read_bytes().split(b"\0")[0].decode() for role in ("scheduler", "worker")}
    assert titles == {"scheduler": "radixserve::scheduler", "worker": "radixserve::worker"}, titles
    thread, result = _stream_in_thread(server.url, {"text": "hello", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})
    _wait_for(lambda: result["events"], 30, "the first streamed token")
    assert server.stop(sig) == 0, server.log()
    thread.join(10)
    assert not thread.is_alive()
    assert result["status"] == 200 and result["done"], result
    final = result["events"][-1]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["completion_tokens"] == 40  # drained, not cut
    assert wait_gone(children) == [], "child processes outlived the server"
    assert "stopped" in server.log()


def test_sigterm_refuses_new_requests_with_503_while_the_stream_in_flight_finishes(tiny_dir, tmp_path):
    server = _start(tiny_dir, tmp_path, "--shutdown-timeout", "60")
    # long enough to be in flight through the checks below, which take well under a second
    thread, result = _stream_in_thread(server.url, {"text": "hello", "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}})
    _wait_for(lambda: result["events"], 30, "the first streamed token")
    server.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: "draining" in server.log(), 10, "the drain to start")
    assert not result.get("done"), "the stream ended before the test could send a request during the drain"
    r = httpx.post(server.url + "/generate", json={"text": "hi"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "shutting_down"
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and "shutting down" in health.json()["reason"]
    assert server.proc.poll() is None, "the server exited while a request was in flight"
    server.proc.wait(60)  # no second signal: server.stop() sends none to an exited process
    assert server.stop() == 0, server.log()
    thread.join(10)
    assert result["status"] == 200 and result["done"], result
    final = result["events"][-1].get("meta_info")
    assert final is not None, (result["events"][-1], server.log()[-3000:])
    assert final["finish_reason"]["type"] == "length" and final["completion_tokens"] == 600, final


@pytest.mark.parametrize("how", ["second_signal", "timeout"])
def test_a_second_signal_or_the_timeout_ends_the_drain_with_an_error_to_the_clients_left(tiny_dir, tmp_path, how):
    server = _start(tiny_dir, tmp_path, "--shutdown-timeout", "60" if how == "second_signal" else "1")
    thread, result = _stream_in_thread(server.url, {"text": "hello", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
    _wait_for(lambda: result["events"], 30, "the first streamed token")
    server.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: "draining" in server.log(), 10, "the drain to start")
    if how == "second_signal":
        server.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    server.proc.wait(30)
    assert server.stop() == 0, server.log()
    assert time.monotonic() - started < 20
    thread.join(10)
    assert result["status"] == 200 and result["done"], result
    error = result["events"][-1]["error"]
    expected = "a second signal" if how == "second_signal" else "--shutdown-timeout (1 s) passed"
    assert "the server is shutting down" in error["message"] and expected in error["message"], error


def test_hung_then_killed_worker_with_no_restarts(tiny_dir, tmp_path):
    """With --max-restarts 0 a dead worker is the end (tests/server/test_recovery.py has restarts)."""
    server = _start(tiny_dir, tmp_path, "--health-timeout", "2", "--max-restarts", "0")
    worker = server.info()["pids"]["worker"]
    children = children_of(server.proc.pid)
    try:
        # hung: the scheduler waits on a stopped worker, so it cannot answer /health
        thread, result = _stream_in_thread(server.url, {"text": "hello", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}})
        _wait_for(lambda: result["events"], 30, "the first streamed token")
        os.kill(worker, signal.SIGSTOP)
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 503 and "did not answer" in r.json()["reason"], r.text
        os.kill(worker, signal.SIGCONT)
        thread.join(30)
        assert result["done"] and result["events"][-1]["meta_info"]["completion_tokens"] == 60
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200

        # killed: in-flight requests end with a 503 error, and the server exits non-zero
        plain: dict = {}

        def plain_request() -> None:
            plain["response"] = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": LONG}, timeout=60)

        t_plain = threading.Thread(target=plain_request, daemon=True)
        t_plain.start()
        t_stream, streamed = _stream_in_thread(server.url, {"text": "hey", "sampling_params": LONG})
        _wait_for(lambda: streamed["events"] and server.info()["requests"]["running"] == 2, 30, "two running requests")
        os.kill(worker, signal.SIGKILL)
        t_plain.join(15)
        t_stream.join(15)
        assert not t_plain.is_alive() and not t_stream.is_alive(), "a request hung after the worker died"
        r = plain["response"]
        assert r.status_code == 503 and "worker process died" in r.json()["error"]["message"], r.text
        assert streamed["done"] and "worker process died" in streamed["events"][-1]["error"]["message"]
        assert "--max-restarts" in r.json()["error"]["message"]
        assert server.proc.wait(30) == 1, server.log()  # for a supervisor to restart it
    finally:
        try:
            os.kill(worker, signal.SIGCONT)  # a failed assertion must not leave it stopped
        except ProcessLookupError:
            pass
        server.stop()
    assert wait_gone(children) == []
    assert "the engine could not be restarted" in server.log()


def test_api_key_guards_every_route_but_health_and_a_full_queue_is_503(tiny_dir, tmp_path):
    server = _start(
        tiny_dir, tmp_path, "--max-running-requests", "1", "--max-queued-requests", "2",
        env={"RADIXSERVE_API_KEY": "s3cret"},
    )
    auth = {"Authorization": "Bearer s3cret"}
    socks = []
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        for method, path in [("POST", "/generate"), ("GET", "/metrics"), ("GET", "/server_info"), ("POST", "/flush_cache"),
                             ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, server.url + path, headers=headers, json={})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(server.url + "/server_info", headers=auth).json()["options"]["api_key"] == "***"
        with openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0) as client:
            assert client.completions.create(model=str(tiny_dir), prompt="hi", max_tokens=2).usage.completion_tokens <= 2
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as client, pytest.raises(openai.AuthenticationError):
            client.models.list()

        # one running, two waiting: the next one is told to come back later
        body = json.dumps({"text": "hello", "sampling_params": LONG}).encode()
        for _ in range(3):
            socks.append(raw_request(server.port, "/generate", body, headers=auth))
            time.sleep(0.3)
        _wait_for(lambda: server.info(**auth)["requests"] == {"running": 1, "waiting": 2}, 20, "a full queue")
        r = httpx.post(server.url + "/generate", json={"text": "hi"}, headers=auth, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "queue is full" in r.json()["error"]["message"]
        for s in socks:
            s.close()
        assert_pages_balanced(server.wait_idle(**auth))
    finally:
        for s in socks:
            s.close()
        assert server.stop() == 0, server.log()


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for f in dataclasses.fields(ServerConfig):
        assert "--" + f.name.replace("_", "-") in out, f.name
        assert HELP[f.name].split()[0] in out
    assert set(HELP) == {f.name for f in dataclasses.fields(ServerConfig)}
    guide = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    missing = [f.name for f in dataclasses.fields(ServerConfig) if f"`--{f.name.replace('_', '-')}`" not in guide]
    assert not missing, f"docs/server.md does not document {missing}"


def test_flags_map_to_config_fields():
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--page-size", "8", "--kv-pages", "100", "--disable-radix-cache",
                              "--dtype", "float32", "--schedule-policy", "fcfs", "--api-key", "k", "--context-len", "512"])
    config = config_from_args(args, parser)
    assert (config.model, config.page_size, config.kv_pages, config.disable_radix_cache) == ("m", 8, 100, True)
    assert (config.dtype, config.schedule_policy, config.api_key, config.context_len) == ("float32", "fcfs", "k", 512)
    assert config_from_args(parser.parse_args(["serve"]), parser) == ServerConfig()
    bad = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--page-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "page_size" in bad.stderr


def test_a_taken_port_fails_fast(tiny_dir):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "radixserve", "serve", "--model", str(tiny_dir), "--host", HOST, "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode != 0 and "cannot listen" in proc.stderr
    assert time.monotonic() - start < 30
