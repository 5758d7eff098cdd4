"""Segment reuse (the `segments` API, docs/cache.md): what blending costs in quality and buys
in speed, on RAG prompts whose retrieved chunks come in a different order each time.

The workload is bench/workloads.py's `rag_multi`: Q questions, each with its top K of C shared
chunks of real text (pydoc_data) in its own order, after one instruction.

1. Quality, in process: the real scheduler and worker driven step by step (no sockets), the
   worker keeping each request's first next-token logits. Each question is computed once by
   full prefill (its prompt as plain ids, in a namespace of its own) and once per recompute
   ratio with its chunks as segments. Per ratio: the mean KL divergence KL(full || blended)
   of the next-token distribution at the answer's first position, the share of questions
   whose first greedy token agrees, and the mean share of the first N greedy tokens that agree
   before the first difference.
2. Speed: the same workload through HTTP at a fixed concurrency, on a server with segments and
   on one started with --disable-segment-cache (the same requests served as plain prompts, the
   prefix cache only), in alternating rounds; medians of mean TTFT, output tokens/s and the
   share of prompt tokens served from a cache.

    python -m bench.segment_reuse
    python -m bench.segment_reuse --skip-speed --ratios 0 0.15 1

Results: stdout and bench/results/segment_reuse.json (docs/benchmarks.md renders them).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.common import (
    add_model,
    add_out,
    add_page_size,
    launch_server,
    new_parser,
    resolved_dtype,
)
from bench.router import cpu_model
from bench.serving import emit_json, load_tokenizer, run_workload
from bench.workloads import Workload, build
from radixserve.config import ServerConfig
from radixserve.protocol import SamplingParams, TokenBatchOut, TokenizedRequest
from radixserve.scheduler.core import Scheduler
from radixserve.worker.worker import Worker

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
TARGETS = {"kl_vs_naive": 0.3, "first_token_agreement": 0.9, "cache_hit_fraction": 0.8,
           "ttft_ratio": 0.4, "throughput_ratio": 2.0}


class _FirstLogitsWorker(Worker):
    """The worker, keeping the logits each sample is first sampled from (the answer's first
    position): the distribution the quality figures compare."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.first_logits: dict[str, torch.Tensor] = {}

    def _sample(self, chunks, sampling, last_logits, all_logits, results) -> None:  # noqa: ANN001
        for i in sampling:  # last_logits: a row per chunk of the forward
            self.first_logits.setdefault(chunks[i].rid, last_logits[i].double())
        super()._sample(chunks, sampling, last_logits, all_logits, results)


def tokenize_segments(tokenizer: Any, pieces: Sequence[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt given as segments, as the front tokenizes it: each piece alone (the first with the
    tokenizer's special tokens), concatenated; every piece but the last is a reusable span."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, piece in enumerate(pieces):
        piece_ids = tokenizer(piece, add_special_tokens=i == 0).input_ids
        if i < len(pieces) - 1:
            spans.append((len(ids), len(ids) + len(piece_ids)))
        ids += piece_ids
    return ids, spans


def _run(sched: Scheduler, worker: Worker, requests: list[TokenizedRequest]) -> dict[int, list[int]]:
    """Serve the requests together, step by step; each one's output tokens."""
    outputs: dict[int, list[int]] = {r.rid: [] for r in requests}
    for req in requests:
        assert sched.add_request(req) is None
    while sched.has_work:
        batch = sched.build_batch()
        if batch is None:
            continue
        sched.process_result(worker.step(batch))
        for message in sched.take_messages():
            assert isinstance(message, TokenBatchOut), message
            for out in message.outputs:
                outputs[out.rid] += out.new_token_ids
    return outputs


def _prefix_agreement(a: list[int], b: list[int], n: int) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a[:n], b[:n], strict=True)) if x != y), n)
    return same / n


def quality(args: argparse.Namespace, workload: Workload, tokenizer: Any) -> dict[str, Any]:
    config = ServerConfig(model=args.model, dtype=args.dtype, page_size=args.page_size, kv_memory_gb=args.kv_memory_gb)
    worker = _FirstLogitsWorker(config)
    sched = Scheduler(config, worker.ready_message(), lambda req: None)
    sampling = SamplingParams(max_new_tokens=args.agreement_tokens, temperature=0.0, ignore_eos=True)
    prompts = [tokenize_segments(tokenizer, root.segments) for root in workload.roots]
    rids = itertools.count()
    full = [TokenizedRequest(next(rids), ids, sampling, cache_salt="full-prefill") for ids, _ in prompts]
    start = time.perf_counter()
    full_out = _run(sched, worker, full)
    full_s = time.perf_counter() - start
    rows: dict[str, Any] = {}
    for ratio in args.ratios:
        blended = [TokenizedRequest(next(rids), ids, sampling, segments=spans, segment_recompute_ratio=ratio)
                   for ids, spans in prompts]
        start = time.perf_counter()
        out = _run(sched, worker, blended)
        seconds = time.perf_counter() - start
        kls, first, prefix = [], [], []
        for ref, req in zip(full, blended, strict=True):
            p = torch.log_softmax(worker.first_logits[f"{ref.rid}#0"], -1)
            q = torch.log_softmax(worker.first_logits[f"{req.rid}#0"], -1)
            kls.append(float((p.exp() * (p - q)).sum()))
            first.append(float(full_out[ref.rid][0] == out[req.rid][0]))
            prefix.append(_prefix_agreement(full_out[ref.rid], out[req.rid], args.agreement_tokens))
        rows[f"{ratio:g}"] = {
            "mean_kl": statistics.fmean(kls), "max_kl": max(kls),
            "first_token_agreement": statistics.fmean(first),
            f"prefix_agreement_{args.agreement_tokens}": statistics.fmean(prefix),
            "seconds": round(seconds, 2),
        }
        print(f"ratio {ratio:g}: {rows[f'{ratio:g}']}", flush=True)
    stats = sched.stats(0)
    naive, default = rows.get("0"), rows.get(f"{args.default_ratio:g}")
    summary = {}
    if naive and default and naive["mean_kl"] > 0:
        summary["kl_vs_naive"] = default["mean_kl"] / naive["mean_kl"]
    return {"ratios": rows, "full_prefill_seconds": round(full_s, 2), "summary": summary,
            "segment_reused_tokens_total": stats.segment_reused_tokens_total,
            "segment_recomputed_tokens_total": stats.segment_recomputed_tokens_total}


def _serving_round(args: argparse.Namespace, workload: Workload, segments: bool) -> dict[str, float]:
    options = ["--dtype", args.dtype, "--page-size", str(args.page_size)]
    if not segments:
        options.append("--disable-segment-cache")
    with launch_server(args.model, *options) as server:
        result = asyncio.run(run_workload(server.url, workload, concurrency=args.concurrency, progress=False,
                                          system="segments" if segments else "prefix cache only"))
    m = result.metrics
    assert m["errors"] == 0, f"{m['errors']} requests failed"
    segment_tokens = sum(r.segment_tokens for r in result.requests)
    prompt_tokens = sum(r.prompt_tokens for r in result.requests)
    return {"mean_ttft_ms": m["mean_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"], "output_tok_s": m["output_throughput"],
            "cache_hit_fraction": m["cache_hit_fraction"], "segment_token_fraction": segment_tokens / prompt_tokens}


def speed(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[name].append(_serving_round(args, workload, segments=name == "on"))
            print(f"round {r + 1} segments {name}: {runs[name][-1]}", flush=True)
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    on, off = medians["on"], medians["off"]
    return {
        "rounds": runs, "median": medians,
        "summary": {"cache_hit_fraction": on["cache_hit_fraction"],
                    "ttft_ratio": on["mean_ttft_ms"] / off["mean_ttft_ms"],
                    "throughput_ratio": on["output_tok_s"] / off["output_tok_s"]},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    add_page_size(parser)
    add_out(parser, "bench/results/segment_reuse.json")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=350)
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request in the speed runs")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--default-ratio", type=float, default=ServerConfig().segment_recompute_ratio)
    parser.add_argument("--agreement-tokens", type=int, default=16)
    parser.add_argument("--kv-memory-gb", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="speed rounds per system, alternating")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = resolved_dtype(args.dtype)
    tokenizer = load_tokenizer(args.model)
    workload = build("rag_multi", tokenizer, chunks=args.chunks, chunk_tokens=args.chunk_tokens,
                     questions=args.questions, top_k=args.top_k, max_tokens=args.max_tokens)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "model": args.model, "dtype": args.dtype,
        "page_size": args.page_size, "workload": workload.describe(), "targets": TARGETS,
        "concurrency": args.concurrency, "default_ratio": args.default_ratio,
    }
    if not args.skip_quality:
        result["quality"] = quality(args, workload, tokenizer)
    if not args.skip_speed:
        result["speed"] = speed(args, workload)
    emit_json(result, args.out)
    return 0 if all(math.isfinite(v) for part in ("quality", "speed") for v in result.get(part, {}).get("summary", {}).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
