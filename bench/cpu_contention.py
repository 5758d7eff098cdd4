"""What a busy process beside the worker costs: decode speed, one sequence and 16 at once, on
an otherwise idle machine and with `--busy` processes that each keep a core busy (a Python
loop, at niceness `--busy-nice`), for the settings given.

The worker's threads meet at a barrier after every parallel loop of every layer. One of them
sharing its core with another process makes the others wait for it, and while they wait,
GNU OpenMP's threads spin (for a while, then sleep): on a machine whose cores the worker takes
all of, anything else that runs (the front's HTTP and tokenizer, the scheduler, a client, a
benchmark) costs the worker more than its share of the CPU, unless the worker gives up the
threads whose cores are busy (worker/thread_governor.py, on by default). Each setting gets a
server of its own, started anew for each of `--repeats` rounds, the settings alternating within
a round: `default` (the server as it is), and one per `--env NAME=VALUE` (an environment
setting) and per `--serve-option OPTION` (a `serve` option), each repeatable.

    python -m bench.cpu_contention --model default --repeats 3 --serve-option=--disable-adaptive-threads
    python -m bench.cpu_contention --model default --repeats 3 --env OMP_WAIT_POLICY=PASSIVE
    python -m bench.cpu_contention --model default --repeats 2 --busy-nice 10 --out bench/results/cpu_contention_nice10.json
"""

from __future__ import annotations

import asyncio
import datetime
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common import add_model, add_out, launch_server, new_parser
from bench.model_runner import machine
from bench.serving import emit_json
from radixserve.kernels import isa

NEW_TOKENS = 128
BATCHES = (1, 16)
BUSY_LOOP = "import os, sys\nos.nice(int(sys.argv[1]))\nwhile True: pass"


async def decode_tok_s(url: str, sequences: int) -> float:
    """Output tokens per second of `sequences` greedy requests sent at once, each NEW_TOKENS long."""
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*[
            client.post(url + "/generate", json={
                "text": f"Story {i}: once upon a time",
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0},
            }) for i in range(sequences)
        ])
        elapsed = time.perf_counter() - start
    for answer in answers:
        answer.raise_for_status()
    return sequences * NEW_TOKENS / elapsed


def measure(url: str, busy: int, nice: int) -> dict[str, float]:
    """Decode tok/s for each batch size while `busy` busy processes run at niceness `nice`."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(nice)]) for _ in range(busy)]
    try:
        time.sleep(0.5)  # let them start spinning
        return {f"decode_{n}": asyncio.run(decode_tok_s(url, n)) for n in BATCHES}
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@dataclass(frozen=True)
class Setting:
    """One server configuration compared: its environment additions and `serve` options."""

    label: str
    env: dict[str, str] = field(default_factory=dict)
    options: tuple[str, ...] = ()


def env_setting(text: str) -> Setting:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--env {text!r}: expected NAME=VALUE")
    return Setting(text, env={name: value})


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {key: {"median_tok_s": statistics.median(r[key] for r in runs), "runs": [round(r[key], 1) for r in runs]}
            for key in runs[0]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment setting for the server, compared with the default (repeatable)")
    parser.add_argument("--serve-option", action="append", default=[], metavar="OPTION",
                        help="a `serve` option, compared with the default (repeatable; "
                             "--serve-option=--disable-adaptive-threads)")
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the worker in the loaded runs")
    parser.add_argument("--busy-nice", type=int, default=0, help="the busy processes' niceness (0: the worker's own)")
    parser.add_argument("--repeats", type=int, default=2)
    add_out(parser, "bench/results/cpu_contention.json")
    args = parser.parse_args(argv)
    settings = [Setting("default"), *map(env_setting, args.env),
                *(Setting(option, options=tuple(shlex.split(option))) for option in args.serve_option)]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {(s.label, b): [] for s in settings for b in (0, args.busy)}
    for round_ in range(args.repeats):
        for setting in settings:
            with launch_server(args.model, "--dtype", args.dtype, *setting.options, env=setting.env) as server:
                for busy in (0, args.busy):
                    result = measure(server.url, busy, args.busy_nice)
                    runs[setting.label, busy].append(result)
                    print(f"round {round_ + 1}, {setting.label}, {busy} busy: "
                          + ", ".join(f"{k} {v:.1f} tok/s" for k, v in result.items()), flush=True)
    rows = []
    for setting in settings:
        idle, loaded = summary(runs[setting.label, 0]), summary(runs[setting.label, args.busy])
        rows.append({"setting": setting.label, "idle": idle, "busy": loaded,
                     "busy_vs_idle": {k: loaded[k]["median_tok_s"] / idle[k]["median_tok_s"] for k in idle}})
    emit_json({"model": args.model, "dtype": args.dtype, "busy_processes": args.busy, "busy_nice": args.busy_nice, "new_tokens": NEW_TOKENS,
               "repeats": args.repeats, "rows": rows, "cpu_isa": str(isa.selected_tier()), "cpu": machine(),
               "date": datetime.date.today().isoformat()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
