"""The default serving suite (`make bench`): every workload on radixserve with the prefix cache
on and off, llama.cpp's server on the same GGUF file (where a build is found and the model is a
GGUF; a line says when it is skipped), and the Hugging Face transformers baselines, in one run,
on one model and dtype; then the report (Markdown table, targets, PNG plots) under bench/results/.

    python -m bench.suite                                  # the default suite (~15 min on 2 CPU cores)
    python -m bench.suite --workload rag --size docs=2     # a part of it
    python -m bench.suite --model /path/to/hf-folder --dtype float32 --quick   # a smoke run

Each radixserve system is one server process (started, warmed up, stopped after its workloads);
its prefix cache is flushed before every workload so no workload helps the next. llama.cpp
(bench/llama_cpp.py: 2 threads, 8 slots, continuous batching, flash attention) gets the same
requests through its OpenAI API, after radixserve's servers have stopped; it has no flush, so
its slots keep what earlier workloads left them. The transformers baselines run in this process
once the servers are gone, so nothing else competes for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common, llama_cpp
from bench.model_runner import machine
from bench.serving import (
    RunResult,
    load_tokenizer,
    markdown_table,
    parse_sizes,
    run_workload,
    write_results,
)
from bench.workloads import WORKLOADS, Workload, build
from radixserve.models.resolve import gguf_file

# Each workload's sizes as (the default suite's, a smoke test's): the default sized so the whole
# suite fits ~15 minutes on 2 CPU cores with SmolLM2-135M in bf16, the smoke test (--quick) a
# handful of requests.
SIZES: dict[str, dict[str, tuple[int, int]]] = {
    "rag": dict(docs=(4, 2), doc_tokens=(1500, 120), questions=(12, 3), max_tokens=(16, 4)),
    "chat": dict(conversations=(8, 2), turns=(8, 2), first_tokens=(600, 60), turn_tokens=(40, 10), max_tokens=(12, 4)),
    "fewshot": dict(examples=(8, 2), example_tokens=(120, 40), questions=(32, 4), question_tokens=(30, 10),
                    max_tokens=(16, 4)),
    "agent": dict(agents=(8, 2), steps=(5, 2), tools=(6, 2), tool_tokens=(80, 20), observation_tokens=(60, 10),
                  max_tokens=(24, 4)),
    "agent_fork": dict(problems=(6, 1), context_tokens=(300, 40), branches=(4, 2), max_tokens=(16, 4)),
    "unique": dict(requests=(32, 4), prompt_tokens=(400, 40), max_tokens=(16, 4)),
    "quote": dict(docs=(4, 1), doc_tokens=(600, 80), questions=(4, 2), max_tokens=(64, 4)),
}
DEFAULT_SIZES: dict[str, dict[str, int]] = {w: {k: v[0] for k, v in sizes.items()} for w, sizes in SIZES.items()}
QUICK_SIZES: dict[str, dict[str, int]] = {w: {k: v[1] for k, v in sizes.items()} for w, sizes in SIZES.items()}
SERVERS: dict[str, tuple[str, ...]] = {
    "radixserve": (),
    "radixserve cache off": ("--disable-radix-cache",),
}
# transformers baselines, where the targets need them; one-at-a-time on the first N requests
# (throughput is a rate: a stated subset is a fair sample).
HF_ONE_AT_A_TIME = {"rag": 12, "unique": 8}
HF_BUDGET_S = 90.0  # a transformers run starts no new request (group) after this many seconds
HF_STATIC = ("rag", "unique")
HF_CONTINUOUS = ("rag", "unique")


def build_workloads(tokenizer: Any, names: Sequence[str], base: dict[str, dict[str, int]],
                    overrides: dict[str, int], seed: int) -> list[Workload]:
    out = []
    for name in names:
        accepted = base[name].keys() | {"seed"}
        sizes = {**base[name], **{k: v for k, v in overrides.items() if k in accepted}}
        out.append(build(name, tokenizer, seed=seed, **sizes))
    return out


def run_servers(args: argparse.Namespace, workloads: list[Workload], timings: dict[str, float]) -> list[RunResult]:
    runs = []
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-"))
    for system, options in SERVERS.items():
        if args.systems and system not in args.systems:
            continue
        start = time.perf_counter()
        log = log_dir / (system.replace(" ", "_") + ".log")
        with common.launch_server(args.model, "--dtype", args.dtype, *args.server_arg, *options, log_path=log) as server:
            url = server.url
            timings[f"{system}: start-up"] = time.perf_counter() - start
            for w in workloads:
                common.flush_cache(url)
                t = time.perf_counter()
                runs.append(asyncio.run(run_workload(url, w, concurrency=args.concurrency, system=system,
                                                     progress=not args.no_progress)))
                timings[f"{system}: {w.name}"] = time.perf_counter() - t
                _say(runs[-1])
    print(f"server logs: {log_dir}", file=sys.stderr)
    return runs


def run_llama_cpp(args: argparse.Namespace, workloads: list[Workload], timings: dict[str, float]) -> list[RunResult]:
    """The llama.cpp system, or a line saying why it is skipped (no build, or no GGUF to serve)."""
    folder, gguf = llama_cpp.bin_dir(), gguf_file(args.model)
    if folder is None or gguf is None:
        why = llama_cpp.skip_line() if folder is None else f"llama.cpp: skipped, {args.model} is not a GGUF file"
        print(why, file=sys.stderr)
        timings[why] = 0.0
        return []
    runs = []
    start = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="radixserve-bench-")) / "llama.cpp.log"
    server = llama_cpp.LlamaServer(folder, gguf, log_path=log)
    try:
        server.wait_healthy(300)
        server.warm_up()
        timings["llama.cpp: start-up"] = time.perf_counter() - start
        for w in workloads:
            t = time.perf_counter()
            runs.append(asyncio.run(run_workload(server.url, w, api="openai", concurrency=args.concurrency,
                                                 system="llama.cpp", progress=not args.no_progress, keepalive=False)))
            timings[f"llama.cpp: {w.name}"] = time.perf_counter() - t
            _say(runs[-1])
    finally:
        server.stop()
    print(f"llama.cpp log: {log}", file=sys.stderr)
    return runs


def run_transformers(args: argparse.Namespace, workloads: list[Workload], timings: dict[str, float]) -> list[RunResult]:
    from bench.baselines import HFBaseline

    start = time.perf_counter()
    hf = HFBaseline(args.model, common.torch_dtype(args.dtype))
    timings["transformers: load"] = time.perf_counter() - start
    runs = []
    progress = not args.no_progress
    for w in workloads:
        jobs = []
        if w.name in HF_ONE_AT_A_TIME and "one" in args.hf:
            jobs.append(("one-at-a-time", lambda w=w: hf.one_at_a_time(w, HF_ONE_AT_A_TIME[w.name], progress, HF_BUDGET_S)))
        if w.name in HF_STATIC and "static" in args.hf:
            jobs.append(("static", lambda w=w: hf.static_batched(w, args.concurrency, progress=progress, budget_s=HF_BUDGET_S)))
        if w.name in HF_CONTINUOUS and "continuous" in args.hf:
            jobs.append(("continuous", lambda w=w: hf.continuous_batching(w, args.concurrency, progress)))
        for label, job in jobs:
            if time.perf_counter() - args.started > 60 * args.deadline_min:
                timings[f"transformers {label}: {w.name} (skipped: past --deadline-min)"] = 0.0
                continue
            t = time.perf_counter()
            runs.append(job())
            timings[f"transformers {label}: {w.name}"] = time.perf_counter() - t
            _say(runs[-1])
    return runs


def _say(run: RunResult) -> None:
    m = run.metrics
    print(f"{run.workload:>10} | {run.system:<32} | {m['completed']:.0f} req, {m['errors']:.0f} errors, "
          f"{m['duration_s']:.1f} s, {m['output_throughput']:.1f} out tok/s, mean TTFT {m['mean_ttft_ms']:.0f} ms, "
          f"cache hit {m['cache_hit_fraction']:.2f}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.new_parser(__doc__)
    common.add_model(parser)
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="repeatable; default: all")
    parser.add_argument("--size", action="append", default=[], help="override a workload size, KEY=VALUE (repeatable)")
    parser.add_argument("--quick", action="store_true", help="a handful of requests per workload (smoke test)")
    common.add_load(parser)
    parser.add_argument("--systems", nargs="*", choices=[*SERVERS, "llama.cpp"],
                        help="servers to run (default: all; llama.cpp where a build is found)")
    common.add_server_arg(parser, help="more `serve` options for every server")
    parser.add_argument("--hf", nargs="*", default=["one", "static", "continuous"],
                        choices=["one", "static", "continuous"], help="transformers baselines to run")
    parser.add_argument("--deadline-min", type=float, default=16.0,
                        help="start no transformers baseline after this many minutes (it is noted as skipped)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="serving", help="results file stem")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = common.resolved_dtype(args.dtype)  # the servers and the transformers baselines alike, named in the results

    started = args.started = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    names = args.workload or list(WORKLOADS)
    workloads = build_workloads(tokenizer, names, QUICK_SIZES if args.quick else DEFAULT_SIZES,
                                parse_sizes(args.size), args.seed)
    for w in workloads:
        print(w.describe(), file=sys.stderr)
    timings: dict[str, float] = {}
    runs = run_servers(args, workloads, timings)
    if not args.systems or "llama.cpp" in args.systems:
        runs += run_llama_cpp(args, workloads, timings)
    if args.hf:
        runs += run_transformers(args, workloads, timings)
    timings["total"] = time.perf_counter() - started

    import torch

    meta = {
        "model": args.model, "dtype": args.dtype, "concurrency": args.concurrency, "seed": args.seed,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(), "cpu": machine(),
        "cpus": _cpus(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "argv": list(sys.argv[1:] if argv is None else argv), "timings_s": timings,
    }
    path = args.out_dir / f"{args.name}.json"
    write_results(runs, path, meta)
    from bench.report import make_report

    report = make_report(path, args.out_dir)
    print(markdown_table(runs))
    print(f"\nwrote {path}, {path.with_suffix('.md')} and {report} ({timings['total']:.0f} s in all)")
    return 0 if all(r.metrics["errors"] == 0 for r in runs) else 1


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
