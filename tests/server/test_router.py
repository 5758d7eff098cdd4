"""radixserve replicas behind SGLang's router (sglang-router 0.3.2), on loopback: the `openai`
client and SGLang's /generate through the router, streaming and not; cache-aware routing finds
the replica holding a prefix; /flush_cache reaches every replica; a replica killed mid-run does
not fail later requests. The replicas and router are the subprocesses `make serve-replicas`
starts (radixserve/replicas.py), each replica's worker on one core with one thread."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from http_helpers import HOST, TINY_OPTIONS, running_server, sse_events, wait_gone
from runtime_helpers import children_of

from radixserve.placement import usable_cpus
from radixserve.replicas import router_available, serve_replicas, split_cores

needs_router = [
    pytest.mark.skipif(not router_available(), reason="sglang-router is not installed: pip install 'radixserve[router]'"),
    pytest.mark.skipif(len(usable_cpus()) < 2, reason="two replicas need two usable cores"),
]


def with_router(test):
    for mark in needs_router:
        test = mark(test)
    return test

# long enough that a repeat is cached (page size 4) and cache_aware's match rate decides the route
DOC = " ".join(f"Fact {i}: the river {random.Random(i).choice('ABCDEFGH')} flows north." for i in range(30))


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> int:
    """A base port with `count` free ports after it, and base + 1000 free (the router's metrics).

    Drawn below the kernel's ephemeral range: a port in it that is free now may be taken by any
    outgoing connection (the tests' own clients) before the router binds it, as happened once.
    """
    top = min(_ephemeral_start(), 65536) - 1001 - count
    for _ in range(200):
        base = random.randint(10000, max(10001, top))
        wanted = [*range(base, base + count), base + 1000]
        try:
            socks = []
            for port in wanted:
                s = socket.socket()
                socks.append(s)
                s.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("router_logs")
    with serve_replicas(str(tiny_dir), 2, free_ports(3), threads_per_replica=1, options=TINY_OPTIONS,
                        log_dir=log_dir, startup_timeout=180) as (replicas, router):
        yield replicas, router


def _generate(url: str, text: str, **extra) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_accepts_what_the_router_adds(tiny_dir: Path, tmp_path: Path):
    """The router re-serializes /generate with SGLang's defaults; a replica must take them, and
    still refuse what it does not do (without the router installed, too)."""
    added = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
             "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
             "return_entropy": False}
    with running_server(tiny_dir, *TINY_OPTIONS, log_dir=tmp_path) as server:
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for extra, status in [(added, 200), ({**added, "model": name}, 200), ({"model": "other"}, 404),
                              ({"log_metrics": "yes"}, 400), ({"background": True}, 400),
                              ({"return_entropy": True}, 400), ({"no_such_field": 1}, 400)]:
            body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, **extra}
            r = httpx.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == status, (extra, r.text)


def test_split_cores():
    assert split_cores(2, cores=(0, 1, 2, 3, 4)) == ([(0, 1), (2, 3)], (4,))
    assert split_cores(2, 1, cores=(0, 1, 2, 3)) == ([(0,), (1,)], (2, 3))
    assert split_cores(1, cores=(4, 5)) == ([(4, 5)], ())
    for bad in [dict(replicas=3), dict(replicas=1, threads=3), dict(replicas=0)]:
        with pytest.raises(ValueError):
            split_cores(cores=(0, 1), **bad)


@with_router
def test_each_replica_is_pinned_to_its_own_core(cluster):
    replicas, _ = cluster
    cores = [httpx.get(r.url + "/server_info", timeout=30).json()["placement"]["worker_cpus"] for r in replicas]
    assert cores == [str(r.cores[0]) for r in replicas] and len(set(cores)) == 2


@with_router
def test_openai_client_through_the_router(cluster):
    _, router = cluster
    model = httpx.get(router.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    assert model  # 0.3.2 names it "unknown": it cannot read radixserve's /server_info (docs/deploy.md)
    with openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        served = httpx.get(cluster[0][0].url + "/v1/models", timeout=30).json()["data"][0]["id"]
        chat = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0,
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
        stream = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0, stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == chat.choices[0].message.content  # greedy: the same text, whichever replica
        text = client.completions.create(model=served, prompt="Once upon a time", max_tokens=4, temperature=0)
        assert text.usage.completion_tokens == 4
        parts = client.completions.create(model=served, prompt="Once upon a time", max_tokens=4, temperature=0,
                                          stream=True)
        assert "".join(c.choices[0].text for c in parts) == text.choices[0].text
        with pytest.raises(openai.NotFoundError):  # the replica's 404 comes through
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


@with_router
def test_generate_through_the_router(cluster):
    _, router = cluster
    out = _generate(router.url, "The quick brown fox", rid="router-rid-1")
    assert out["meta_info"]["completion_tokens"] == 4 and out["meta_info"]["id"] == "router-rid-1"
    body = {"text": "The quick brown fox", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        events, done = sse_events(list(r.iter_lines()))
    assert done and events[-1]["text"] == out["text"] and events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # SGLang's name for the per-request seed is the one the router passes on (it drops `seed`)
    seeded = [_generate(router.url, f"Seeded {i}", sampling_params={"max_new_tokens": 6, "sampling_seed": 7})
              for i in range(2)]
    again = [_generate(router.url, f"Seeded {i}", sampling_params={"max_new_tokens": 6, "sampling_seed": 7})
             for i in range(2)]
    assert [o["output_ids"] for o in seeded] == [o["output_ids"] for o in again]


@with_router
def test_cache_aware_routes_a_prefix_back_to_its_replica(cluster):
    replicas, router = cluster
    assert httpx.post(router.url + "/flush_cache", timeout=30).status_code == 200
    for r in replicas:  # the router's /flush_cache reached every replica
        assert httpx.get(r.url + "/server_info", timeout=30).json()["pages"]["cached"] == 0
    first = _generate(router.url, DOC + " Question 1: which way?")
    assert first["meta_info"]["cached_tokens"] == 0
    hits = [_generate(router.url, DOC + f" Question {i}: which way?")["meta_info"]["cached_tokens"] for i in range(2, 6)]
    # every follow-up went to the replica holding the document (round robin would alternate)
    assert min(hits) >= first["meta_info"]["prompt_tokens"] // 2, hits
    cached = [httpx.get(r.url + "/server_info", timeout=30).json()["pages"]["cached"] for r in replicas]
    assert sorted(cached)[0] == 0 < sorted(cached)[1], cached  # one replica holds the document


@pytest.fixture
def fresh_cluster(tiny_dir: Path, tmp_path: Path):
    with serve_replicas(str(tiny_dir), 2, free_ports(3), threads_per_replica=1, options=TINY_OPTIONS,
                        log_dir=tmp_path, startup_timeout=180) as (replicas, router):
        yield replicas, router


def _running(url: str) -> int:
    info = httpx.get(url + "/server_info", timeout=30).json()
    return info["requests"]["running"] + info["requests"]["waiting"]


@with_router
def test_a_replica_killed_mid_run_does_not_fail_later_requests(fresh_cluster):
    replicas, router = fresh_cluster
    # a long stream, in flight on one replica when it is killed
    body = {"text": DOC, "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    outcome: dict[str, object] = {"lines": []}
    streaming = threading.Event()  # set on the first token event: the replica has sent its headers

    def stream() -> None:
        try:
            with httpx.stream("POST", router.url + "/generate", json=body, timeout=120) as r:
                outcome["status"] = r.status_code
                for line in r.iter_lines():
                    outcome["lines"].append(line)
                    if line.startswith("data: {"):
                        streaming.set()
        except httpx.HTTPError as exc:
            outcome["error"] = exc
        finally:
            streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    # Kill only once tokens flow. Killed before its first byte (still queued or in prefill), the
    # request is one the router may retry on the survivor, which then streams it whole: that is
    # the router doing its job, and it would say nothing about a replica dying mid-stream.
    assert streaming.wait(60), "the long request never started"
    assert reader.is_alive(), f"the stream ended before the kill: {outcome}"
    deadline = time.monotonic() + 30
    victim = None
    while victim is None and time.monotonic() < deadline:
        victim = next((r for r in replicas if _running(r.url)), None)
        time.sleep(0.02)
    assert victim is not None, "no replica reports the streaming request"
    survivor = next(r for r in replicas if r is not victim)
    family = [victim.proc.pid, *children_of(victim.proc.pid)]
    os.kill(victim.proc.pid, signal.SIGKILL)  # no shutdown: the worst case for the router
    assert not wait_gone(family), "the killed replica left processes behind"
    reader.join(120)
    assert not reader.is_alive()
    # the stream that was on it ends (an error event, or cut short), never hangs
    events, _ = sse_events([ln for ln in outcome["lines"] if ln.startswith(("data: [DONE]", "data: {"))])
    assert events and events[-1].get("meta_info", {}).get("completion_tokens", 0) < 900

    # every later request succeeds, at once (retried on the survivor) and after the health check
    with openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        served = httpx.get(survivor.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for i in range(8):
            out = _generate(router.url, DOC + f" Later question {i}?")
            assert out["meta_info"]["completion_tokens"] == 4
            chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                  max_tokens=3)
            assert chat.usage.completion_tokens == 3
    deadline = time.monotonic() + 30
    while router.healthy_workers() != 1:
        assert time.monotonic() < deadline, "the router never marked the killed replica unhealthy"
        time.sleep(0.5)
    body = {"text": "After", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=120) as r:
        events, done = sse_events(list(r.iter_lines()))
    assert r.status_code == 200 and done and events[-1]["meta_info"]["completion_tokens"] == 3


@with_router
@pytest.mark.slow
def test_default_model_replicas_through_the_router(tmp_path: Path):
    """The issue's set-up: the default model (its Q4_1 weights kept quantized, the default), two
    replicas with one thread each. A chat turn answers through the router; the completion that
    follows knows its capital."""
    with serve_replicas("default", 2, free_ports(3), threads_per_replica=1, log_dir=tmp_path,
                        startup_timeout=300) as (_, router):
        with openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
            chat = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=8, temperature=0,
            )
            assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens > 0
        out = _generate(router.url, "The capital of France is", sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert "Paris" in out["text"]
        body = {"text": "The capital of France is", "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        with httpx.stream("POST", router.url + "/generate", json=body, timeout=300) as r:
            events, done = sse_events(list(r.iter_lines()))
        assert done and events[-1]["text"] == out["text"]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
