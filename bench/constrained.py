"""What constrained decoding costs: output tokens/s with half the requests JSON-schema
constrained, against the same requests all unconstrained, on one server in one run.

Every request asks for `--max-tokens` tokens and gets exactly that many: unconstrained ones
ignore EOS, constrained ones follow a schema whose outputs are longer than that (an array of at
least 64 records), so both runs compute the same tokens and the ratio of their rates is the cost
of the grammar work (compiles, per-step bitmasks in the scheduler, masking in the worker). The
schema is the same for every constrained request: it must compile once, and the rest are cache
hits (read from /metrics).

    python -m bench.constrained --model default --concurrency 16 --requests 64

The runs alternate, unconstrained and half constrained (`--rounds` of the latter, 3 by default),
and the ratio is the median of each half-constrained run against the mean of its neighbours: on
a 2-core machine one run's rate moves by several percent from the next.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.common import (
    add_model,
    add_out,
    flush_cache,
    launch_server,
    new_parser,
    read_metric_totals,
)
from bench.corpus import QUESTIONS
from bench.serving import emit_json
from radixserve.kernels import isa

SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": {"type": "string", "maxLength": 16}},
        "required": ["id", "name"],
    },
}
METRICS = ("radixserve_grammar_compiles_total", "radixserve_grammar_cache_hits_total")


def run(url: str, requests: int, concurrency: int, max_tokens: int, constrained_share: float) -> dict[str, float]:
    """Send `requests` requests, `concurrency` at a time; every k-th is constrained."""
    every = round(1 / constrained_share) if constrained_share else 0
    schema = json.dumps(SCHEMA)

    def one(i: int) -> tuple[int, bool]:
        sampling: dict[str, object] = {"max_new_tokens": max_tokens, "temperature": 0.0}
        constrained = bool(every) and i % every == 0
        if constrained:
            sampling["json_schema"] = schema
        else:
            sampling["ignore_eos"] = True
        text = f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]} Answer as JSON records."
        out = httpx.post(url + "/generate", json={"text": text, "sampling_params": sampling}, timeout=600).json()
        if constrained:
            assert out["text"].startswith("[{"), out["text"][:80]
        return out["meta_info"]["completion_tokens"], constrained

    flush_cache(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    elapsed = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    return {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
            "constrained_requests": sum(c for _, c in results)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3,
                        help="half-constrained runs, each between two unconstrained ones; the ratio is their median")
    add_out(parser, "bench/results/constrained.json")
    args = parser.parse_args(argv)
    with launch_server(args.model, "--dtype", args.dtype) as server:
        url = server.url
        run(url, args.concurrency, args.concurrency, 8, 0.5)  # warm-up: the schema's compile, the kernels
        before = read_metric_totals(url, METRICS)
        free = [run(url, args.requests, args.concurrency, args.max_tokens, 0.0)]
        half = []
        for _ in range(args.rounds):  # U H U H ... U: each H against the mean of its neighbours
            half.append(run(url, args.requests, args.concurrency, args.max_tokens, 0.5))
            free.append(run(url, args.requests, args.concurrency, args.max_tokens, 0.0))
        after = read_metric_totals(url, METRICS)
    rate = [r["output_tokens_per_s"] for r in free]
    ratios = [h["output_tokens_per_s"] / ((rate[k] + rate[k + 1]) / 2) for k, h in enumerate(half)]
    result = {
        "model": args.model, "dtype": args.dtype, "cpu_isa": str(isa.selected_tier()),
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "unconstrained": free, "half_constrained": half, "ratios": ratios,
        "ratio": statistics.median(ratios),
        "compiles_during_runs": after[METRICS[0]] - before[METRICS[0]],
        "cache_hits_during_runs": after[METRICS[1]] - before[METRICS[1]],
    }
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
