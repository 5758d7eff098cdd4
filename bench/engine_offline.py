"""Offline throughput on a shared-prefix workload: radix cache on vs off, same run.

    python -m bench.engine_offline [--docs 8 --doc-tokens 1000 --questions 8 --max-new-tokens 16]

D documents of ~L tokens (Python's documentation topics), Q short questions on each, all
submitted at once to an `Engine`. Three systems, each a fresh engine on the default model:

- `cache on`: the default (lpm policy, which also deduplicates prefills within a burst);
- `cache on, fcfs`: the same cache without in-batch deduplication (shows what dedup buys
  on a burst of questions over documents that are not cached yet);
- `cache off`: `--disable-radix-cache`, the baseline.

Output lengths are fixed (`ignore_eos`) so every system generates the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.common import add_documents, add_model, new_parser
from bench.corpus import documents, question
from radixserve import Engine

SYSTEMS = {
    "cache on (lpm + dedup)": {},
    "cache on, fcfs (no dedup)": {"schedule_policy": "fcfs"},
    "cache off": {"disable_radix_cache": True},
}


def prompts_for(tokenizer: Any, args: argparse.Namespace) -> list[str]:
    docs = documents(tokenizer, args.docs, args.doc_tokens)
    return [
        f"{doc}\n\nQuestion: {question(d * args.questions + q)}\nAnswer:"
        for d, doc in enumerate(docs)
        for q in range(args.questions)
    ]


def run_system(name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    with Engine(model=args.model, dtype=args.dtype, chunk_size=args.chunk_size, **options) as engine:
        prompts = prompts_for(engine.tokenizer, args)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.generate(prompts[0][-200:], {"max_new_tokens": 2})  # warm-up, unrelated prefix
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "system": name,
        "requests": len(outs),
        "seconds": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cache_hit_fraction": cached / prompt_tokens,
    }


def main() -> None:
    parser = new_parser(__doc__)
    add_model(parser)
    add_documents(parser, docs=8, doc_tokens=1000, questions=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = [run_system(name, opts, args) for name, opts in SYSTEMS.items()]
    base = rows[-1]["output_tok_s"]
    print(f"workload: {args.docs} docs x ~{args.doc_tokens} tokens, {args.questions} questions each, "
          f"{args.max_new_tokens} output tokens, dtype {args.dtype}")
    print("| system | s | output tok/s | total tok/s | cache-hit fraction | vs cache off |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['seconds']:.1f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.0f} | "
              f"{r['cache_hit_fraction']:.3f} | {r['output_tok_s'] / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
