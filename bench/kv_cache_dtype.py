"""The quantized KV cache (--kv-cache-dtype, docs/cache.md): what each 8-bit kind holds, what it
costs in quality, and what the extra capacity buys a RAG server whose documents outgrow a bf16
pool. Every figure has the bf16 KV cache as its baseline, measured in the same run.

1. Capacity: the pool's tokens (/server_info) at the same --kv-memory-gb. Target: >= 1.9x bf16
   for every 8-bit kind.
2. Quality (the default model; real text from pydoc_data): P prompts of 1-2k tokens, each
   served once per KV dtype:
   - greedy agreement with the bf16 KV cache over the first N output tokens: each prompt is
     followed by bf16's N greedy tokens (teacher forcing), and the share of those positions
     whose greedy prediction (prompt top-1 logprob) equals bf16's is taken; also, free running,
     the share of each dtype's own N greedy tokens before its first difference from bf16's (one
     flipped near-tie ends it: an fp32 KV cache, more precise than bf16, is the reference row);
   - the perplexity of each prompt's last H tokens (held out: prompt logprobs, computed over
     the stored KV).
   Targets: agreement >= 0.9 for fp8_e4m3 and int8; perplexity within 2% of bf16.
3. Speed: bench/disk_tier.py's thrash set-up, memory only (the rag workload on a pool that
   holds the requests in flight but not the documents), on a pool of the same bytes for every
   dtype; bf16 and each 8-bit kind alternate, medians. Target: output tok/s >= 1.5x bf16.

    python -m bench.kv_cache_dtype
    python -m bench.kv_cache_dtype --skip-speed --prompts 4

Results: stdout and bench/results/kv_cache_dtype.json (docs/benchmarks.md renders them).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.common import add_documents, add_model, add_out, add_page_size, launch_server, new_parser
from bench.router import cpu_model
from bench.serving import emit_json, load_tokenizer, run_workload
from bench.workloads import TextPool, build

EIGHT_BIT = ("fp8_e4m3", "fp8_e5m2", "int8")
TARGETS = {"capacity_ratio": 1.9, "agreement": 0.9, "perplexity_ratio": 1.02, "throughput_ratio": 1.5}


def _prompts(tokenizer: Any, count: int, held_out: int, seed: int) -> list[list[int]]:
    """`count` prompts of 1-2k tokens of real text, each a run of documentation."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    return [tokenizer(pool.take(rng.randint(1024, 2048 - held_out) + held_out), add_special_tokens=False).input_ids
            for _ in range(count)]


def _serve_prompts(url: str, prompts: list[list[int]], held_out: int, max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt's greedy output and its last `held_out` tokens' logprobs."""
    out = []
    with httpx.Client(timeout=600) as client:
        for ids in prompts:
            body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": len(ids) - held_out,
                    "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}
            resp = client.post(url + "/generate", json=body)
            resp.raise_for_status()
            meta = resp.json()["meta_info"]
            logprobs = [lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None][-held_out:]
            out.append({"output_ids": [t for _, t, _ in meta["output_token_logprobs"]], "logprobs": logprobs})
    return out


def _forced_predictions(url: str, forced: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """Teacher forcing: for each (prompt, continuation), the greedy (top-1) prediction at each
    continuation position given the prompt and the continuation before it."""
    out = []
    with httpx.Client(timeout=600) as client:
        for prompt, continuation in forced:
            body = {"input_ids": prompt + continuation, "return_logprob": True, "logprob_start_len": len(prompt),
                    "top_logprobs_num": 1, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
            resp = client.post(url + "/generate", json=body)
            resp.raise_for_status()
            top = resp.json()["meta_info"]["input_top_logprobs"][-len(continuation):]
            out.append([entries[0][1] for entries in top])
    return out


def _prefix_share(a: list[int], b: list[int], n: int) -> float:
    """The share of the first n tokens of a before its first difference from b."""
    same = 0
    for x, y in zip(a[:n], b[:n], strict=True):
        if x != y:
            break
        same += 1
    return same / n


def _positionwise(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def quality(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """bf16 first (its outputs are what the others are forced along), then the reference
    (fp32 KV: what a more precise cache changes) and the 8-bit kinds."""
    prompts = _prompts(tokenizer, args.prompts, args.held_out, args.seed)
    n = args.agreement_tokens
    served: dict[str, list[dict[str, Any]]] = {}
    predicted: dict[str, list[list[int]]] = {}
    tokens: dict[str, int] = {}
    forced: list[tuple[list[int], list[int]]] = []
    for dtype in ("bfloat16", "float32", *EIGHT_BIT):
        with launch_server(args.model, "--dtype", args.dtype, "--page-size", str(args.page_size),
                           "--kv-cache-dtype", dtype, "--kv-memory-gb", str(args.kv_memory_gb)) as server:
            tokens[dtype] = httpx.get(server.url + "/server_info", timeout=30).json()["pages"]["tokens"]
            served[dtype] = _serve_prompts(server.url, prompts, args.held_out, n)
            if dtype == "bfloat16":
                forced = [(p, r["output_ids"]) for p, r in zip(prompts, served[dtype], strict=True)]
            predicted[dtype] = _forced_predictions(server.url, forced)
        print(f"quality: {dtype} served ({tokens[dtype]} pool tokens)", flush=True)
    base = served["bfloat16"]

    def perplexity(runs: list[dict[str, Any]]) -> float:
        lps = [lp for r in runs for lp in r["logprobs"]]
        return math.exp(-sum(lps) / len(lps))

    base_ppl = perplexity(base)
    per_dtype = {}
    for dtype in ("float32", *EIGHT_BIT):
        runs = served[dtype]
        ppl = perplexity(runs)
        per_dtype[dtype] = {
            "capacity_ratio": tokens[dtype] / tokens["bfloat16"],
            "agreement": statistics.mean(_positionwise(a, b) for a, b in
                                         zip(predicted[dtype], predicted["bfloat16"], strict=True)),
            "free_running_agreement": statistics.mean(_prefix_share(r["output_ids"], b["output_ids"], n)
                                                      for r, b in zip(runs, base, strict=True)),
            "perplexity": ppl, "perplexity_ratio": ppl / base_ppl,
        }
        print(f"  {dtype}: {per_dtype[dtype]}", flush=True)
    return {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "held_out": args.held_out,
            "agreement_tokens": n, "bf16_perplexity": base_ppl, "pool_tokens": tokens,
            "kv_memory_gb": args.kv_memory_gb, "per_dtype": per_dtype}


def _bf16_page_bytes(model: str, page_size: int) -> int:
    """Bytes of one bf16 KV page of the model (its config.json): the speed runs' pool is
    --kv-pages of them, whatever the dtype."""
    import json

    from radixserve.attention.kv_pool import KVPool
    from radixserve.kernels.kv_quant import FORMATS
    from radixserve.models.resolve import resolve_model

    cfg = json.loads((resolve_model(model, weights=False) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return KVPool.bytes_per_page(cfg["num_hidden_layers"], page_size, cfg.get("num_key_value_heads", heads),
                                 head_dim, FORMATS["bfloat16"])


def _thrash_run(args: argparse.Namespace, workload: Any, dtype: str) -> dict[str, float]:
    memory_gb = args.kv_pages * _bf16_page_bytes(args.model, args.page_size) / 2**30
    options = ["--dtype", args.dtype, "--page-size", str(args.page_size), "--kv-cache-dtype", dtype,
               "--kv-memory-gb", f"{memory_gb:.9f}"]
    with launch_server(args.model, *options) as server:
        tokens = httpx.get(server.url + "/server_info", timeout=30).json()["pages"]["tokens"]
        result = asyncio.run(run_workload(server.url, workload, concurrency=args.concurrency, progress=False,
                                          system=f"{dtype} KV"))
    m = result.metrics
    assert m["errors"] == 0, f"{m['errors']} requests failed"
    return {"pool_tokens": tokens, "mean_ttft_ms": m["mean_ttft_ms"], "output_tok_s": m["output_throughput"],
            "cache_hit_fraction": m["cache_hit_fraction"]}


def speed(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    workload = build("rag", tokenizer, docs=args.docs, doc_tokens=args.doc_tokens, questions=args.questions,
                     max_tokens=args.max_tokens)
    kinds = ("bfloat16", *args.speed_dtypes)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for dtype in kinds if r % 2 == 0 else tuple(reversed(kinds)):
            runs[dtype].append(_thrash_run(args, workload, dtype))
            print(f"round {r + 1} {dtype}: {runs[dtype][-1]}", flush=True)
    medians = {k: {m: statistics.median(run[m] for run in rs) for m in rs[0]} for k, rs in runs.items()}
    base = medians["bfloat16"]
    return {"workload": workload.describe(), "bf16_pages": args.kv_pages, "concurrency": args.concurrency,
            "rounds": runs, "median": medians,
            "summary": {k: {"throughput_ratio": medians[k]["output_tok_s"] / base["output_tok_s"],
                            "ttft_ratio": medians[k]["mean_ttft_ms"] / base["mean_ttft_ms"]}
                        for k in args.speed_dtypes}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    add_page_size(parser)
    add_out(parser, "bench/results/kv_cache_dtype.json")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=256, help="tokens at each prompt's end scored for perplexity")
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--kv-memory-gb", type=float, default=2.0, help="the pool of the quality and capacity runs")
    parser.add_argument("--seed", type=int, default=0)
    add_documents(parser, docs=4, doc_tokens=600, questions=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kv-pages", type=int, default=96,
                        help="the speed runs' pool in bf16 pages (bench/disk_tier.py's); other dtypes get its bytes")
    parser.add_argument("--speed-dtypes", nargs="+", default=["int8", "fp8_e4m3"], choices=EIGHT_BIT)
    parser.add_argument("--rounds", type=int, default=2, help="speed rounds per dtype, alternating")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = "bfloat16"
    tokenizer = load_tokenizer(args.model)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "model": args.model,
                              "dtype": args.dtype, "page_size": args.page_size, "targets": TARGETS}
    if not args.skip_quality:
        result["quality"] = quality(args, tokenizer)
    if not args.skip_speed:
        result["speed"] = speed(args, tokenizer)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
