"""Replicas behind SGLang's router: does cache-aware routing keep the prefix cache's gain?

    python -m bench.router                         # the rag workload, the default model (a few minutes on 2 cores)
    python -m bench.router --quick --model /path/to/hf-folder --dtype float32   # a smoke run

Two radixserve replicas start once, each worker pinned to its own core(s) with one thread per
core (radixserve/replicas.py); then, in one run, the same rag workload (bench/workloads.py: a few
long documents, many short questions on each, in a shuffled order) goes through the router
(sglang-router 0.3.2) in front of:

- `1 replica`: replica 0 alone, the baseline (what one process on those cores gets);
- `2 replicas cache_aware`: both, routed by the router's approximate radix tree per replica;
- `2 replicas round_robin`: both, alternated, blind to prefixes.

Every replica's cache is flushed before each system. Reported per system: the fraction of prompt
tokens served from the prefix cache and the TTFT (bench/serving.py's metrics), plus the ratios
that say whether cache-aware routing keeps the prefix cache's gain: cache_aware's hit fraction
over the single replica's (target >= 0.9), and cache_aware against round_robin on hit fraction
and mean TTFT (target: better on both). Results:
bench/results/router.json and .md; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common, serving
from bench.suite import DEFAULT_SIZES, QUICK_SIZES
from bench.workloads import build
from radixserve.placement import format_cpu_list
from radixserve.replicas import ROUTER_VERSION, Replica, Router, router_available, split_cores

SYSTEMS: tuple[tuple[str, int, str], ...] = (  # label, replicas routed to, policy
    ("1 replica", 1, "cache_aware"),
    ("2 replicas cache_aware", 2, "cache_aware"),
    ("2 replicas round_robin", 2, "round_robin"),
)


def cpu_model() -> str:
    """`lscpu`'s model name (what docs/benchmarks.md names the machine by)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or platform.machine()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def ratios(runs: Sequence[serving.RunResult]) -> dict[str, float]:
    """The routing comparisons (the module's docstring), from the three systems' metrics."""
    by = {r.system: r.metrics for r in runs}
    one, ca, rr = by["1 replica"], by["2 replicas cache_aware"], by["2 replicas round_robin"]
    return {
        "hit_cache_aware_over_single": ca["cache_hit_fraction"] / one["cache_hit_fraction"] if one["cache_hit_fraction"] else float("nan"),
        "hit_cache_aware_minus_round_robin": ca["cache_hit_fraction"] - rr["cache_hit_fraction"],
        "mean_ttft_round_robin_over_cache_aware": rr["mean_ttft_ms"] / ca["mean_ttft_ms"],
    }


def verdict(r: dict[str, float]) -> list[str]:
    return [
        f"cache_aware hit fraction / single replica's: {r['hit_cache_aware_over_single']:.3f} (target >= 0.9): "
        + ("met" if r["hit_cache_aware_over_single"] >= 0.9 else "NOT met"),
        f"cache_aware hit fraction - round_robin's: {r['hit_cache_aware_minus_round_robin']:+.3f} (target > 0): "
        + ("met" if r["hit_cache_aware_minus_round_robin"] > 0 else "NOT met"),
        f"round_robin mean TTFT / cache_aware's: {r['mean_ttft_round_robin_over_cache_aware']:.2f}x (target > 1): "
        + ("met" if r["mean_ttft_round_robin_over_cache_aware"] > 1 else "NOT met"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.new_parser(__doc__)
    common.add_model(parser)
    parser.add_argument("--size", action="append", default=[], help="override a rag size, KEY=VALUE (repeatable)")
    parser.add_argument("--quick", action="store_true", help="a handful of requests (smoke test)")
    common.add_load(parser)
    parser.add_argument("--threads-per-replica", type=int, default=1, help="cores (one thread each) per replica's worker")
    common.add_server_arg(parser, help="more `serve` options for every replica")
    common.add_out(parser, "bench/results/router.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = common.resolved_dtype(args.dtype)  # the replicas run on CPU cores; named in the results
    if not router_available():
        parser.error(f"sglang-router is not installed: pip install 'radixserve[router]' (sglang-router=={ROUTER_VERSION})")
    started = time.perf_counter()
    sizes = {**(QUICK_SIZES if args.quick else DEFAULT_SIZES)["rag"], **serving.parse_sizes(args.size)}
    workload = build("rag", serving.load_tokenizer(args.model), seed=args.seed, **sizes)
    print(workload.describe(), file=sys.stderr)
    slices, spare = split_cores(2, args.threads_per_replica)
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-router-"))
    options = ["--dtype", args.dtype, *args.server_arg]
    replicas = [Replica(i, args.model, common.free_port(), slices[i], spare, options, common.HOST, log_dir) for i in range(2)]
    runs: list[serving.RunResult] = []
    timings: dict[str, float] = {}
    try:
        for r in replicas:
            r.wait_healthy(600)
            common.warm_up(r.url)
        timings["start-up"] = time.perf_counter() - started
        for label, count, policy in SYSTEMS:
            for r in replicas:
                common.flush_cache(r.url)
            router = Router([r.url for r in replicas[:count]], common.free_port(), policy=policy, host=common.HOST,
                            prometheus_port=common.free_port(), log_path=log_dir / f"router_{label.replace(' ', '_')}.log")
            try:
                router.wait_ready()
                common.warm_up(router.url)  # the router's first connections and tree, then every cache flushed
                seen = [finished_requests(r.url) for r in replicas]
                t = time.perf_counter()
                run = asyncio.run(serving.run_workload(router.url, workload, concurrency=args.concurrency, seed=args.seed,
                                               system=label, progress=not args.no_progress))
                timings[label] = time.perf_counter() - t
            finally:
                router.stop()
            now = [finished_requests(r.url) for r in replicas]
            run.note = ", ".join(f"{b - a}" for a, b in zip(seen[:count], now[:count])) + " req per replica"
            runs.append(run)
            m = run.metrics
            print(f"{label:<24} {m['completed']:.0f} req, {m['errors']:.0f} errors, cache hit {m['cache_hit_fraction']:.3f}, "
                  f"mean TTFT {m['mean_ttft_ms']:.0f} ms ({run.note})", file=sys.stderr, flush=True)
    finally:
        for r in replicas:
            r.stop()
    result = ratios(runs)
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "model": args.model, "dtype": args.dtype, "concurrency": args.concurrency, "seed": args.seed,
        "router": f"sglang-router {ROUTER_VERSION}",
        "replica_cores": [format_cpu_list(s) for s in slices], "spare_cores": format_cpu_list(spare),
        "workload": dict(workload.params), "ratios": result, "timings_s": timings,
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    serving.write_results(runs, args.out, meta)
    print(serving.markdown_table(runs))
    for line in verdict(result):
        print(line)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} (replica and router logs: {log_dir})")
    return 0 if all(r.metrics["errors"] == 0 for r in runs) else 1


def finished_requests(url: str) -> int:
    """Sequences a replica has finished (its /metrics counter, every finish reason): the
    difference over a run shows how the router split the load."""
    name = "radixserve_requests_finished_total"
    return int(common.read_metric_totals(url, [name])[name])


if __name__ == "__main__":
    sys.exit(main())
