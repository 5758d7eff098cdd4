"""`python -m bench.robustness.soak`: hundreds of concurrent streams for minutes, clients hanging
up at random and the worker killed mid-run; nothing may be lost. A robustness tool, not a
benchmark: its figures say whether anything was lost, not how fast.

Each of `--clients` client loops sends one streaming `/generate` after another (a slice of real
text, `ignore_eos`, a known number of tokens, greedy or seeded) until `--duration` passes; about a
third of the requests hang up after a random number of events. The worker is SIGKILLed `--kills`
times, evenly spaced. Every stream that stayed connected must end with `[DONE]` and exactly its
`max_new_tokens`, its cumulative events only ever extending one another; any error, 5xx or
short stream is a lost request. At the end every KV page must be free or cached, and each
process's memory (sampled every few seconds, by role, per pid) must be flat after its warm-up.
Figures: stdout and bench/results/soak.json; exit code 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import httpx

from bench.common import (
    add_model,
    add_out,
    add_server_arg,
    launch_server,
    metric_totals,
    new_parser,
)
from bench.serving import emit_json

WARM_UP_S = 60.0  # a process's memory counts from this long after it (or the run) started
MEMORY_TOLERANCE = 0.10
SAMPLE_EVERY_S = 5.0


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # completed, disconnected, lost
    statuses: Counter = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)  # why, for the first few

    def lose(self, why: str) -> None:
        self.outcomes["lost"] += 1
        if len(self.lost) < 20:
            self.lost.append(why)


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, text: str, tally: Tally) -> None:
    start = rng.randrange(0, len(text) - 600)
    tokens = rng.randint(8, 64)
    params: dict[str, Any] = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    if rng.random() < 0.3:
        params.update(temperature=0.8, seed=rng.randrange(1 << 30))
    body = {"text": text[start : start + rng.randint(100, 600)], "stream": True, "sampling_params": params}
    hang_up_after = rng.randint(1, tokens) if rng.random() < 1 / 3 else None
    events: list[dict[str, Any]] = []
    done = False
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            tally.statuses[r.status_code] += 1
            if r.status_code != 200:
                tally.lose(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if hang_up_after is not None and len(events) >= hang_up_after:
                        tally.outcomes["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        tally.lose(f"{type(exc).__name__}: {exc}")
        return
    if hang_up_after is not None and done:
        tally.outcomes["completed_before_hang_up"] += 1
        return
    last = events[-1] if events else {}
    if "error" in last:
        tally.statuses[f"error event: {last['error'].get('type')}"] += 1
        tally.lose(f"error event: {last['error'].get('message')}")
    elif not done or last.get("meta_info", {}).get("completion_tokens") != tokens:
        tally.lose(f"short stream: done={done}, {last.get('meta_info', {}).get('completion_tokens')} of {tokens}")
    elif any(b["output_ids"][: len(a["output_ids"])] != a["output_ids"] for a, b in zip(events, events[1:])):
        tally.lose("a later event does not extend an earlier one")
    else:
        tally.outcomes["completed"] += 1


async def client_loop(url: str, seed: int, deadline: float, text: str, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0)) as client:
        while time.monotonic() < deadline:
            await one_request(client, url, rng, text, tally)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


async def watch(url: str, start: float, deadline: float, kills: int, memory: list[dict[str, Any]],
                kill_log: list[dict[str, Any]]) -> None:
    """Sample every process's memory; kill the worker `kills` times, evenly spaced."""
    kill_at = [start + (deadline - start) * (k + 1) / (kills + 1) for k in range(kills)]
    async with httpx.AsyncClient(timeout=30.0) as client:
        next_sample = start
        while time.monotonic() < deadline:
            now = time.monotonic()
            if kill_at and now >= kill_at[0]:
                kill_at.pop(0)
                pid = (await client.get(url + "/server_info")).json()["pids"]["worker"]
                os.kill(pid, signal.SIGKILL)
                back = time.monotonic()
                while (await client.get(url + "/health")).status_code != 200:
                    await asyncio.sleep(0.05)
                kill_log.append({"at_s": round(now - start, 1), "worker_pid": pid,
                                 "healthy_again_after_s": round(time.monotonic() - back, 2)})
            if now >= next_sample:
                next_sample += SAMPLE_EVERY_S
                with contextlib.suppress(httpx.HTTPError):
                    pids = (await client.get(url + "/server_info")).json()["pids"]
                    for role, pid in pids.items():
                        if (kib := rss_kib(pid)) is not None:
                            memory.append({"t": round(now - start, 1), "role": role, "pid": pid, "rss_kib": kib})
            await asyncio.sleep(0.2)


def memory_growth(memory: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process: its RSS growth from the end of its warm-up to its last sample."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for m in memory:
        by_pid.setdefault(m["pid"], []).append(m)
    out = {}
    for pid, samples in by_pid.items():
        settled = [m for m in samples if m["t"] >= max(WARM_UP_S, samples[0]["t"] + WARM_UP_S)]
        if len(settled) < 2:
            continue  # lived too short (a worker killed soon after its start)
        first, last = settled[0]["rss_kib"], settled[-1]["rss_kib"]
        out[f"{samples[0]['role']} {pid}"] = {"from_mib": round(first / 1024, 1), "to_mib": round(last / 1024, 1),
                                               "growth": round(last / first - 1, 4)}
    return out


async def soak(url: str, args: argparse.Namespace) -> dict[str, Any]:
    text = "\n".join(topics.values())  # real English: Python's documentation topics
    tally = Tally()
    memory: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    start = time.monotonic()
    deadline = start + args.duration
    clients = [client_loop(url, args.seed * 100_000 + i, deadline, text, tally) for i in range(args.clients)]
    await asyncio.gather(watch(url, start, deadline, args.kills, memory, kills), *clients)
    elapsed = time.monotonic() - start
    async with httpx.AsyncClient(timeout=30.0) as client:
        for _ in range(200):  # disconnected requests end at the scheduler's next step
            info = (await client.get(url + "/server_info")).json()
            if info["requests"] == {"running": 0, "waiting": 0}:
                break
            await asyncio.sleep(0.1)
        metrics = (await client.get(url + "/metrics")).text
    growth = memory_growth(memory)

    recovery = metric_totals(metrics, ["radixserve_engine_restarts_total", "radixserve_requests_recovered_total"])
    pages = info["pages"]
    return {
        "clients": args.clients, "duration_s": round(elapsed, 1), "requests": sum(tally.statuses.values()),
        "outcomes": dict(tally.outcomes), "statuses": {str(k): v for k, v in tally.statuses.items()},
        "lost_examples": tally.lost, "kills": kills,
        "engine_restarts_total": recovery["radixserve_engine_restarts_total"],
        "requests_recovered_total": recovery["radixserve_requests_recovered_total"],
        "pages_at_end": pages,
        "pages_balanced": pages["in_use"] == 0 and pages["free"] + pages["cached"] == pages["total"],
        "memory_growth_after_warm_up": growth,
        # None: no process lived past its warm-up (a run shorter than WARM_UP_S says nothing)
        "memory_flat": all(abs(g["growth"]) <= MEMORY_TOLERANCE for g in growth.values()) if growth else None,
    }


def main() -> int:
    p = new_parser(__doc__, prog="python -m bench.robustness.soak")
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--clients", type=int, default=500)
    p.add_argument("--duration", type=float, default=300.0, help="seconds")
    p.add_argument("--kills", type=int, default=2, help="times the worker is SIGKILLed, evenly spaced")
    p.add_argument("--seed", type=int, default=0)
    add_model(p, default="tiny", dtype=False,
              help="without --url: the model to serve; `tiny`: a 2-layer random model on the default tokenizer")
    add_server_arg(p, help="more `serve` options without --url")
    add_out(p, "bench/results/soak.json")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from bench.robustness.fuzz.__main__ import tiny_model

            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
            model = str(tiny_model(work / "tiny")) if args.model == "tiny" else args.model
            options = ["--dtype", "float32", "--kv-pages", "4096", "--max-restarts", str(args.kills + 1), *args.server_arg]
            print(f"soak: starting `radixserve serve --model {args.model}`", file=sys.stderr)
            url = stack.enter_context(launch_server(model, *options, log_path=args.out.with_suffix(".server.log"))).url
        print(f"soak: {args.clients} clients for {args.duration:g} s, {args.kills} worker kills", file=sys.stderr)
        result = asyncio.run(soak(url, args))
    from bench.model_runner import machine

    result["machine"] = machine()
    emit_json(result, args.out)
    five_xx = sum(v for k, v in result["statuses"].items() if k.startswith("5") or "server_error" in k)
    ok = (not result["outcomes"].get("lost") and not five_xx and result["pages_balanced"]
          and result["memory_flat"] is not False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
