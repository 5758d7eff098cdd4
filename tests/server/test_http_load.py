"""A bounded load test over loopback: 300 concurrent requests (240 streaming), a third of them
hanging up mid-answer. Every other request must complete with the right output, nothing may
answer 5xx, and afterwards every KV page must be free or cached."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from http_helpers import (
    HOST,
    TINY_OPTIONS,
    Server,
    assert_pages_balanced,
    metric_samples,
)

STREAMS = 240
PLAIN = 60
NEW_TOKENS = 8
LEAVER_TOKENS = 1500  # what a leaving client asked for: minutes of decoding unless it is aborted
PREFIXES = ["You are a helpful assistant. Answer in one word.", "Context: the fox is brown and the dog is lazy."]
QUESTIONS = ["What colour?", "Which animal?", "How many legs?", "Is it fast?", "Where does it live?", "Why?"]
PROMPTS = [f"{p} {q}" for p in PREFIXES for q in QUESTIONS]
TIME_LIMIT_S = 300


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--log-level", "warning")


def _body(i: int, leaves: bool, stream: bool) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": LEAVER_TOKENS if leaves else NEW_TOKENS, "ignore_eos": True}
    return {"text": PROMPTS[i % len(PROMPTS)], "sampling_params": params, "stream": stream}


async def _stream(client: httpx.AsyncClient, i: int, leaves: bool) -> tuple[int, dict | None]:
    """Status and final event; a leaving client hangs up after its second event."""
    final, seen = None, 0
    async with client.stream("POST", "/generate", json=_body(i, leaves, stream=True)) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                final, seen = json.loads(line[6:]), seen + 1
                if leaves and seen == 2:
                    return 200, None  # leaving the block closes the connection mid-stream
    return 200, final


async def _plain(client: httpx.AsyncClient, port: int, i: int, leaves: bool) -> tuple[int, dict | None]:
    if not leaves:
        r = await client.post("/generate", json=_body(i, leaves, stream=False))
        return r.status_code, r.json() if r.status_code == 200 else None
    _, writer = await asyncio.open_connection(HOST, port)
    payload = json.dumps(_body(i, leaves, stream=False)).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    writer.write(head.encode() + payload)
    await writer.drain()
    await asyncio.sleep(0.5)
    writer.close()  # hang up before the answer
    return 200, None


async def _load(server: Server) -> list[tuple[int, bool, tuple[int, dict | None]]]:
    limits = httpx.Limits(max_connections=STREAMS + PLAIN, max_keepalive_connections=STREAMS + PLAIN)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        jobs = [(i, i % 3 == 0, _stream(client, i, i % 3 == 0)) for i in range(STREAMS)]
        jobs += [(i, i % 3 == 0, _plain(client, server.port, i, i % 3 == 0)) for i in range(STREAMS, STREAMS + PLAIN)]
        results = await asyncio.wait_for(asyncio.gather(*(job for _, _, job in jobs)), TIME_LIMIT_S)
    return [(i, leaves, result) for (i, leaves, _), result in zip(jobs, results)]


def _generated_tokens(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return metric_samples(text)["radixserve_generation_tokens_total"]


def test_many_streaming_clients_some_leaving(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        expected = {}
        for prompt in PROMPTS:
            body = {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
            expected[prompt] = client.post("/generate", json=body).json()
    generated_before = _generated_tokens(server)
    results = asyncio.run(_load(server))
    assert len(results) == STREAMS + PLAIN
    statuses = [status for _, _, (status, _) in results]
    assert all(s < 500 for s in statuses), sorted(set(statuses))
    completed = [(i, out) for i, leaves, (_, out) in results if not leaves]
    assert len(completed) == 200
    for i, out in completed:
        want = expected[PROMPTS[i % len(PROMPTS)]]
        assert out is not None, i
        assert out["output_ids"] == want["output_ids"] and out["text"] == want["text"], i
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    info = server.wait_idle(timeout=10)  # the leavers were aborted, not decoded to the end
    assert_pages_balanced(info)
    leavers = STREAMS // 3 + PLAIN // 3
    assert _generated_tokens(server) - generated_before < 200 * NEW_TOKENS + leavers * LEAVER_TOKENS // 5
    assert info["pages"]["cached"] > 0  # the shared prefixes stayed cached
    assert server.proc.poll() is None
