"""Hostile clients against the real server: prompts of megabytes, clients that hang up in the middle
of an upload, and slow ("slowloris") clients that send a header or a body a byte at a time.

None of them may stall the event loop (`/health` keeps answering within seconds), fill the log
with tracebacks, or hold a connection open for ever.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from http_helpers import HOST, TINY_OPTIONS

# A long context, so that a prompt within the character bound can still take seconds to tokenize.
CONTEXT = 65536
HEADER_TIMEOUT, BODY_TIMEOUT = 1.0, 3.0
LONGEST_TOKEN_CHARS = 81  # of the default model's tokenizer: a newline and 80 spaces
CHAR_BOUND = CONTEXT * LONGEST_TOKEN_CHARS
# Spaces tokenize at 64 to a token, slowly (seconds for millions): within the character bound,
# this is 78,125 tokens, over the context only once tokenized.
SLOW_PROMPT = " " * 5_000_000
HEALTH_WITHIN_S = 2.0  # before the fix, /health waited for the whole tokenization (3 s and more)
SLACK_S = 10.0  # a loaded machine may close a connection late, never this late


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    model = tiny_model(max_position_embeddings=CONTEXT)
    options = (
        "--kv-pages", str(CONTEXT // 4),  # page size 4: the pool holds one full context
        "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
    )
    return start_server(model, *TINY_OPTIONS, *options)


def _while_polling_health(url: str, work: Callable[[], Any]) -> tuple[Any, float, int]:
    """Run `work` in a thread and poll /health until it is done; returns its result, the slowest
    /health answer, and how many answers came while it ran."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(value=work()), daemon=True)
    slowest, polls = 0.0, 0
    with httpx.Client(base_url=url, timeout=120) as client:
        thread.start()
        time.sleep(0.2)  # let the upload start
        while thread.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            slowest, polls = max(slowest, time.monotonic() - start), polls + 1
            time.sleep(0.1)
    thread.join()
    return result["value"], slowest, polls


# ---------------------------------------------------------------------- huge prompts


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": SLOW_PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SLOW_PROMPT}]}),
    ],
    ids=["generate", "chat"],
)
def test_tokenizing_a_huge_prompt_does_not_stall_other_routes(server, path, body):
    def post() -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=120)

    r, slowest, polls = _while_polling_health(server.url, post)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text[:300]
    assert polls >= 1, "the request finished before /health was asked"
    assert slowest < HEALTH_WITHIN_S, f"/health took {slowest:.1f} s while a prompt was tokenized"


@pytest.mark.parametrize(
    ("path", "body", "param", "what"),
    [
        ("/generate", {"text": "x" * (CHAR_BOUND + 1)}, "text", "`text`"),
        ("/generate", {"text": ["hi", "x" * (CHAR_BOUND + 1)]}, "text", "`text[1]`"),
        ("/v1/completions", {"prompt": "x" * (CHAR_BOUND + 1)}, "prompt", "`prompt`"),
        ("/v1/completions", {"prompt": ["hi", "x" * (CHAR_BOUND + 1)]}, "prompt", "`prompt[1]`"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (CHAR_BOUND // 2)}] * 3}, "messages", "messages"),
    ],
    ids=["generate", "generate batch", "completions", "completions batch", "chat"],
)
def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(server, path, body, param, what):
    r = httpx.post(server.url + path, json=body, timeout=120)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text[:300]
    message = error["message"]
    assert what in message and f"{CHAR_BOUND} characters" in message and f"{CONTEXT} tokens" in message, message


def test_a_body_of_millions_of_arrays_does_not_stall_other_routes(server):
    """Decoding builds millions of objects; before the fix the garbage collector walked them
    again and again on the event loop (3 s and more for these 15 MB)."""
    junk = b"[" + b"[]," * 5_000_000 + b"[]]"
    body = b'{"prompt": "hi", "max_tokens": 1, "junk": ' + junk + b"}"

    def post() -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120)

    r, slowest, _ = _while_polling_health(server.url, post)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text[:300]
    assert slowest < HEALTH_WITHIN_S, f"/health took {slowest:.1f} s while a body was decoded"


# ---------------------------------------------------------------------- disconnects


def _head(path: str, length: int, method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_clients_that_hang_up_mid_upload_leave_no_tracebacks(server):
    body = json.dumps({"text": "hello " * 20_000}).encode()
    for _ in range(20):
        with socket.create_connection((HOST, server.port)) as sock:
            sock.sendall(_head("/generate", len(body)) + body[: len(body) // 2])
            time.sleep(0.05)  # the route is reading the body when the client leaves
    time.sleep(1.0)  # before the fix, each left a traceback within milliseconds
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    log = server.log()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
    assert " 500" not in log, log[-3000:]


# ---------------------------------------------------------------------- slow clients


def _closed_within(sock: socket.socket, timeout: float, trickle: bytes = b"") -> tuple[bytes, float]:
    """Read until the server closes the connection, sending `trickle` every 0.2 s meanwhile;
    returns what the server sent and when it closed. Fails if it is still open after `timeout`."""
    start, received = time.monotonic(), b""
    sock.settimeout(0.2)
    while time.monotonic() - start < timeout:
        if trickle:
            try:
                sock.sendall(trickle)
            except OSError:  # closed by the server (reset)
                return received, time.monotonic() - start
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return received, time.monotonic() - start
        if not data:
            return received, time.monotonic() - start
        received += data
    raise AssertionError(f"the connection is still open after {timeout:.0f} s; received {received[:200]!r}")


def test_slow_and_silent_headers_are_cut_off_and_health_stays_responsive(server):
    socks = []
    try:
        for i in range(30):
            sock = socket.create_connection((HOST, server.port))
            if i % 3:  # some send part of a header, some nothing at all
                sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        assert time.monotonic() - start < HEALTH_WITHIN_S
        for sock in socks:
            received, _ = _closed_within(sock, HEADER_TIMEOUT + SLACK_S)
            assert received == b""
        # a header sent a byte at a time: each byte is progress, but the whole must come in time
        with socket.create_connection((HOST, server.port)) as sock:
            _, took = _closed_within(sock, HEADER_TIMEOUT + SLACK_S, trickle=b"X")
            assert took >= HEADER_TIMEOUT * 0.5
    finally:
        for sock in socks:
            sock.close()


def test_a_body_that_trickles_gets_408(server):
    with socket.create_connection((HOST, server.port)) as sock:
        sock.sendall(_head("/generate", 100_000) + b'{"text": "')
        received, took = _closed_within(sock, BODY_TIMEOUT + SLACK_S, trickle=b"a")
    assert took >= BODY_TIMEOUT * 0.5
    if received:  # else the server's close reset the connection before the answer was read
        head, _, payload = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), received[:300]
        assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200


def test_a_body_left_unread_cannot_keep_the_connection_open(server):
    """The answer comes without the body (a route that reads none); the rest of the body must
    still arrive in time, or the connection is closed."""
    with socket.create_connection((HOST, server.port)) as sock:
        sock.sendall(_head("/health", 100_000, method="GET"))
        received, took = _closed_within(sock, BODY_TIMEOUT + SLACK_S, trickle=b"a")
    assert received.startswith(b"HTTP/1.1 200"), received[:300]
