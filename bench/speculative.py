"""Speculative decoding by prompt lookup: decode speed with `--speculative-algorithm ngram`
against without it, same model, same requests, greedy (so the outputs must be equal too).

Workloads (the default model, one `Engine` per system, run one after the other):
- `quote`: a RAG-style request that copies its document (a Python documentation topic, then
  "Repeat the text above word for word"), one at a time: what speculation is for;
- `fresh`: requests whose answers repeat little of their prompt, one at a time: the drafts
  are mostly rejected, and it must not be slower;
- `busy`: 16 requests at once (the quote and fresh prompts): above `--speculative-max-batch-size`
  speculation steps aside, so it must not be slower either.

Speed is decode tokens per second: a request's output tokens after the first over its time
after the first token, summed over requests. Results: stdout and bench/results/speculative.json.

    python -m bench.speculative
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pydoc_data.topics import topics
from typing import Any

from bench.common import add_model, add_out, new_parser
from bench.serving import emit_json
from radixserve.config import ServerConfig

FRESH = ["Write a short poem about autumn leaves.", "Explain why the sky is blue.",
         "List three uses of a paperclip.", "Describe a cat to someone who has never seen one."]


def quote_prompts(count: int) -> list[str]:
    names = sorted(topics, key=lambda k: -len(topics[k]))[:count]
    return [topics[n][:1200] + "\n\nRepeat the text above word for word:\n" for n in names]


def decode_rate(outs: list[dict[str, Any]]) -> float:
    tokens = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
    seconds = sum(o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"] for o in outs)
    return tokens / seconds


def measure(model: str, dtype: str, options: dict[str, Any], workloads: dict[str, tuple[list[str], bool]],
            max_tokens: int) -> dict[str, Any]:
    from radixserve import Engine

    params = {"max_new_tokens": max_tokens, "temperature": 0.0}
    results: dict[str, Any] = {}
    with Engine(model=model, dtype=dtype, **options) as engine:
        engine.generate(FRESH[0], {"max_new_tokens": 8})  # warm-up
        for name, (prompts, together) in workloads.items():
            start = time.perf_counter()
            if together:
                outs = engine.generate(prompts, params)
            else:
                outs = [engine.generate(p, params) for p in prompts]
            results[name] = {
                "seconds": time.perf_counter() - start, "decode_tokens_per_s": decode_rate(outs),
                "accepted": sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs),
                "completion_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
                "output_ids": [o["output_ids"] for o in outs],
            }
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=ServerConfig.speculative_num_draft_tokens,
                        help="--speculative-num-draft-tokens (default: the server's)")
    add_out(parser, "bench/results/speculative.json")
    args = parser.parse_args(argv)
    quotes = quote_prompts(4)
    workloads = {"quote": (quotes, False), "fresh": (FRESH, False), "busy": ((quotes + FRESH) * 2, True)}
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens}
    plain = measure(args.model, args.dtype, {}, workloads, args.max_tokens)
    fast = measure(args.model, args.dtype, spec, workloads, args.max_tokens)
    from bench.model_runner import machine

    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "machine": machine(),
                              "draft_tokens": args.draft_tokens, "max_tokens": args.max_tokens}
    for name in workloads:
        a, b = plain[name], fast[name]
        result[name] = {
            "requests": len(workloads[name][0]),
            "plain_decode_tokens_per_s": round(a["decode_tokens_per_s"], 1),
            "spec_decode_tokens_per_s": round(b["decode_tokens_per_s"], 1),
            "ratio": round(b["decode_tokens_per_s"] / a["decode_tokens_per_s"], 3),
            "accepted_per_output_token": round(b["accepted"] / b["completion_tokens"], 3),
            "outputs_equal": a["output_ids"] == b["output_ids"],
        }
    emit_json(result, args.out)
    return 0 if all(result[n]["outputs_equal"] for n in workloads) else 1


if __name__ == "__main__":
    raise SystemExit(main())
