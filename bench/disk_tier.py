"""The disk tier (--kv-disk-dir): what it buys a RAG server whose documents outgrow its KV pool,
and the first request after a restart.

Two measurements, each with its baseline in the same run (the default model unless --model):

1. `thrash`: the rag workload (D documents of L tokens, Q questions each, in a shuffled order,
   at a fixed concurrency) on a KV pool that holds the requests in flight but not all the
   documents, so memory alone keeps evicting documents before their next question comes. Disk tier off, then on:
   mean TTFT, output tokens/s and the prompt tokens served from a cache. The runs alternate
   (off, on, off, on, ...) and the medians are reported.
2. `restart`: each document asked once on a server with the disk tier (its KV goes to disk as
   the pool evicts and the server stops), then the server is restarted on the same directory
   and each document asked a new question: the mean first-request TTFT of the restarted server
   against a cold one (no disk tier), in alternation. Target: <= 0.3x.

    python -m bench.disk_tier
    python -m bench.disk_tier --docs 6 --doc-tokens 1000 --kv-pages 160 --rounds 3

Results: stdout and bench/results/disk_tier.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import add_documents, add_model, add_out, add_page_size, launch_server, new_parser
from bench.router import cpu_model
from bench.serving import emit_json, load_tokenizer, run_workload
from bench.workloads import Workload, build


def _serve_options(args: argparse.Namespace, disk: Path | None) -> list[str]:
    options = ["--dtype", args.dtype, "--page-size", str(args.page_size), "--kv-pages", str(args.kv_pages)]
    if disk is not None:
        options += ["--kv-disk-dir", str(disk)]
    return options


def _thrash_run(args: argparse.Namespace, workload: Workload, disk: Path | None) -> dict[str, float]:
    with launch_server(args.model, *_serve_options(args, disk)) as server:
        result = asyncio.run(run_workload(server.url, workload, concurrency=args.concurrency, progress=False,
                                          system="disk tier on" if disk else "memory only"))
    m = result.metrics
    assert m["errors"] == 0, f"{m['errors']} requests failed"
    return {"mean_ttft_ms": m["mean_ttft_ms"], "output_tok_s": m["output_throughput"],
            "cache_hit_fraction": m["cache_hit_fraction"]}


def _first_requests(url: str, workload: Workload) -> list[float]:
    """TTFT of each document's request, one after the other."""
    result = asyncio.run(run_workload(url, workload, concurrency=1, progress=False))
    assert result.metrics["errors"] == 0, "requests failed"
    return [r.ttft for r in result.requests]


def _other_questions(workload: Workload) -> Workload:
    """The same documents with other questions: after a restart only the documents are cached."""
    roots = tuple(dataclasses.replace(r, text=r.text.replace("\nQuestion: ", "\nQuestion: In a few words, "))
                  for r in workload.roots)
    return dataclasses.replace(workload, roots=roots)


def _restart_round(args: argparse.Namespace, first: Workload, second: Workload) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="radixserve-disk-") as tmp:
        disk = Path(tmp) / "kv"
        with launch_server(args.model, *_serve_options(args, disk)) as server:
            _first_requests(server.url, first)  # computes every document; the pool sends them to disk
        start = time.perf_counter()
        with launch_server(args.model, *_serve_options(args, disk), flush=False) as server:
            restart_s = time.perf_counter() - start
            warm = _first_requests(server.url, second)
    with launch_server(args.model, *_serve_options(args, None)) as server:
        cold = _first_requests(server.url, second)
    return {"restart_ttft_ms": 1000 * statistics.mean(warm), "cold_ttft_ms": 1000 * statistics.mean(cold),
            "ratio": statistics.mean(warm) / statistics.mean(cold), "restart_to_healthy_s": restart_s}


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    add_page_size(parser)
    add_documents(parser, docs=4, doc_tokens=600, questions=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kv-pages", type=int, default=96,
                        help="the pool: the requests in flight fit, the documents (about 2,600 tokens) do not")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs of each measurement")
    add_out(parser, "bench/results/disk_tier.json")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.model)
    rag = build("rag", tokenizer, docs=args.docs, doc_tokens=args.doc_tokens, questions=args.questions,
                max_tokens=args.max_tokens)
    first = build("rag", tokenizer, docs=args.docs, doc_tokens=args.doc_tokens, questions=1,
                  max_tokens=args.max_tokens)  # the thrash run's documents (the seed picks them)
    second = _other_questions(first)
    thrash: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    restarts: list[dict[str, float]] = []
    for round_ in range(args.rounds):
        for mode in ("off", "on"):
            with tempfile.TemporaryDirectory(prefix="radixserve-disk-") as tmp:
                run = _thrash_run(args, rag, Path(tmp) / "kv" if mode == "on" else None)
            thrash[mode].append(run)
            print(f"round {round_ + 1} thrash {mode}: {run}", flush=True)
        restarts.append(_restart_round(args, first, second))
        print(f"round {round_ + 1} restart: {restarts[-1]}", flush=True)

    def median(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    summary = {
        "thrash": {
            mode: {k: median(runs, k) for k in runs[0]} for mode, runs in thrash.items()
        },
        "restart": {k: median(restarts, k) for k in restarts[0]},
    }
    off, on = summary["thrash"]["off"], summary["thrash"]["on"]
    summary["thrash"]["ttft_ratio_on_vs_off"] = on["mean_ttft_ms"] / off["mean_ttft_ms"]
    summary["thrash"]["throughput_ratio_on_vs_off"] = on["output_tok_s"] / off["output_tok_s"]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(), "args": vars(args) | {"out": str(args.out)}}
    emit_json({"meta": meta, "summary": summary, "thrash_runs": thrash, "restart_runs": restarts}, args.out)
    print(f"\nthrash (median of {args.rounds}): memory only {off}\n  disk tier {on}")
    print(f"  TTFT on/off {summary['thrash']['ttft_ratio_on_vs_off']:.2f}x, "
          f"output tok/s on/off {summary['thrash']['throughput_ratio_on_vs_off']:.2f}x")
    r = summary["restart"]
    print(f"restart: first-request TTFT {r['restart_ttft_ms']:.0f} ms vs cold {r['cold_ttft_ms']:.0f} ms "
          f"= {r['ratio']:.2f}x (target <= 0.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
