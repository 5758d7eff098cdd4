"""Serving benchmark: an asyncio load generator against a running server (radixserve's native
/generate or any OpenAI-compatible /v1/completions), streaming every request.

    python -m bench.serving --url http://127.0.0.1:30000 --workload rag --concurrency 16
    python -m bench.serving --launch --model default --workload chat --size conversations=4
    python -m bench.serving --launch --server-arg=--disable-radix-cache --workload unique --rate 2

Per request it records TTFT, every inter-token gap, end-to-end latency and the prompt / cached /
output token counts the server reports; per run it prints and writes (JSON + Markdown)
requests/s, output tokens/s, total tokens/s, mean/p50/p90/p99 TTFT, TPOT, inter-token latency
and end-to-end latency, the fraction of prompt tokens served from the prefix cache, and errors.

Load: `--concurrency N` keeps at most N requests in flight (a closed loop); `--rate R` sends the
workload's first requests as a Poisson process of R requests/s (with `--concurrency` as well, at
most N of them in flight). Follow-up requests (chat turns, agent steps, fork branches, see
bench/workloads.py) are sent as soon as the request they depend on has finished, with its real
output in their prompt, ahead of requests not yet started.

Output lengths are fixed (`ignore_eos`), greedy, so every system generates the same token counts.
The full suite with the baselines is bench/suite.py (`make bench`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    add_load,
    add_model,
    add_out,
    add_server_arg,
    flush_cache,
    launch_server,
    metric_totals,
    new_parser,
)
from bench.workloads import WORKLOADS, Node, Workload, build

APIS = ("generate", "openai")


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `sent` from the start of the run."""

    group: str
    sent: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    segment_tokens: int = 0  # of cached_tokens, reused from radixserve's segment cache
    output_tokens: int = 0
    error: str | None = None
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """mean/p50/p90/p99 in milliseconds."""
    ms = [v * 1000.0 for v in values]
    return {
        f"mean_{prefix}_ms": sum(ms) / len(ms) if ms else math.nan,
        **{f"p{q}_{prefix}_ms": percentile(ms, q) for q in (50, 90, 99)},
    }


def warm_flags(records: Sequence[RequestRecord]) -> list[bool]:
    """Whether each request was sent after another request of its group had produced its first
    token, i.e. after the prefix they share had been computed once ("warm"), else "cold"."""
    first_token: dict[str, list[float]] = {}
    for r in records:
        if r.ok:
            first_token.setdefault(r.group, []).append(r.sent + r.ttft)
    return [any(t <= r.sent for t in first_token.get(r.group, ())) for r in records]


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, float]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    warm = warm_flags(records)
    ttft_warm = [r.ttft for r, w in zip(records, warm, strict=True) if r.ok and w]
    ttft_cold = [r.ttft for r, w in zip(records, warm, strict=True) if r.ok and not w]
    return {
        "duration_s": duration,
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "cache_hit_fraction": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", [t for r in ok if (t := r.tpot) is not None]),
        **_stats("itl", [g for r in ok for g in r.itl]),
        **_stats("e2e", [r.e2e for r in ok]),
        "warm_requests": len(ttft_warm),
        "cold_requests": len(ttft_cold),
        "mean_ttft_warm_ms": 1000 * sum(ttft_warm) / len(ttft_warm) if ttft_warm else math.nan,
        "mean_ttft_cold_ms": 1000 * sum(ttft_cold) / len(ttft_cold) if ttft_cold else math.nan,
    }


@dataclass
class RunResult:
    """One workload on one system."""

    workload: str
    system: str
    params: dict[str, Any]
    load: dict[str, Any]
    metrics: dict[str, float]
    requests: list[RequestRecord]
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for r in out["requests"]:
            r.pop("output")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        requests = [RequestRecord(**r) for r in data["requests"]]
        return cls(**{**data, "requests": requests})


# ---------------------------------------------------------------------- one request


def _sse_data(line: str) -> str | None:
    return line[len("data:"):].strip() if line.startswith("data:") else None


async def _stream_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord
) -> AsyncIterator[dict[str, Any]]:
    """POST `body` and yield each SSE event as JSON; an HTTP or in-stream error ends the
    stream and is recorded on `rec`."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            return
        async for line in resp.aiter_lines():
            data = _sse_data(line)
            if data is None or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                rec.error = str(event["error"].get("message", event["error"]))
                return
            yield event


async def send_generate(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                        rec: RequestRecord, t0: float, segments: Sequence[str] = ()) -> None:
    """POST /generate with SSE streaming; `text` and `output_ids` are cumulative. With
    `segments` (a prompt split into them) they are sent instead of the text."""
    body: dict[str, Any] = {"segments": list(segments)} if segments else {"text": prompt}
    body |= {"stream": True, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    seen, last = 0, None
    async for event in _stream_events(client, url + "/generate", body, rec):
        now = time.perf_counter() - t0
        n = len(event.get("output_ids") or ())
        if n > seen:
            if last is None:
                rec.ttft = now - rec.sent
            else:
                rec.itl.append(now - last)
            seen, last = n, now
        rec.output = event.get("text", rec.output)
        meta = event.get("meta_info") or {}
        rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
        rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens)
        rec.output_tokens = meta.get("completion_tokens", rec.output_tokens)
        rec.segment_tokens = meta.get("segment_tokens", rec.segment_tokens)


async def send_openai(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      rec: RequestRecord, t0: float, model: str | None = None) -> None:
    """POST /v1/completions with streaming and `stream_options.include_usage`; `model` is
    left out unless given (radixserve serves one model)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    last = None
    async for chunk in _stream_events(client, url + "/v1/completions", body, rec):
        now = time.perf_counter() - t0
        for choice in chunk.get("choices") or ():
            if choice.get("text"):
                if last is None:
                    rec.ttft = now - rec.sent
                else:
                    rec.itl.append(now - last)
                last = now
                rec.output += choice["text"]
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage["prompt_tokens"]
            rec.output_tokens = usage["completion_tokens"]
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


# ---------------------------------------------------------------------- the load


class Slots:
    """A concurrency limit whose waiters are served by priority (lowest first), then in order."""

    def __init__(self, limit: int | None) -> None:
        self.free = limit if limit else math.inf
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        await fut

    def release(self) -> None:
        if self._waiters:
            heapq.heappop(self._waiters)[2].set_result(None)  # the slot passes to the waiter
        else:
            self.free += 1


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_workload(url: str, workload: Workload, *, api: str = "generate", concurrency: int | None = 16,
                       rate: float | None = None, seed: int = 0, system: str = "", model: str | None = None,
                       progress: bool = True, keepalive: bool = True) -> RunResult:
    """Send every request of `workload` (respecting its dependencies) and collect the records.
    `keepalive` False opens a connection per request: for servers that close a kept-alive
    connection after some number of requests (llama-server's HTTP library), where a request
    sent on it at that moment fails with "Server disconnected without sending a response"."""
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, not {api!r}")
    if not concurrency and not rate:
        raise ValueError("give a concurrency limit, a request rate, or both")
    slots = Slots(concurrency)
    records: list[RequestRecord] = []
    bar = Progress(workload.num_requests, f"{workload.name} on {system or url}", progress)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=(concurrency or 64) if keepalive else 0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = time.perf_counter()

        async def do(node: Node, prompt: str, depth: int) -> None:
            rec = RequestRecord(group=node.group)
            records.append(rec)
            await slots.acquire(-depth)  # follow-ups of started programs first
            rec.sent = time.perf_counter() - t0
            try:
                if api == "generate":
                    # a root's segments: radixserve's segment cache (a follow-up's prompt is text)
                    segments = node.segments if depth == 0 else ()
                    await send_generate(client, url, prompt, node.max_tokens, rec, t0, segments)
                else:
                    await send_openai(client, url, prompt, node.max_tokens, rec, t0, model)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
            finally:
                rec.e2e = time.perf_counter() - t0 - rec.sent
                slots.release()
                bar.update()
            if rec.ok:
                await asyncio.gather(*(do(c, prompt + rec.output + c.text, depth + 1) for c in node.children))

        tasks = []
        for root in workload.roots:
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(do(root, root.text, 0)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    load = {"api": api, "concurrency": concurrency, "rate": rate, "seed": seed}
    return RunResult(workload.name, system or url, dict(workload.params), load, summarize(records, duration), records)


# ---------------------------------------------------------------------- the server's counters


SPEC_COUNTERS = ("radixserve_spec_draft_tokens_total", "radixserve_spec_accepted_tokens_total")


def spec_counters(url: str) -> tuple[float, float] | None:
    """The server's draft and accepted token counters (speculative decoding), summed over their
    labels; None where /metrics cannot be read (an API key, another server)."""
    try:
        resp = httpx.get(url + "/metrics", timeout=30)
        if resp.status_code != 200:
            return None
        totals = metric_totals(resp.text, SPEC_COUNTERS)
    except (httpx.HTTPError, KeyError):
        return None
    return totals[SPEC_COUNTERS[0]], totals[SPEC_COUNTERS[1]]


def add_acceptance(metrics: dict[str, float], before: tuple[float, float] | None,
                   after: tuple[float, float] | None) -> None:
    """The run's draft tokens, accepted tokens and their ratio, from the counters around it
    (left out where nothing was drafted)."""
    if before is None or after is None or after[0] == before[0]:
        return
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    metrics.update(spec_draft_tokens=drafted, spec_accepted_tokens=accepted, spec_acceptance_rate=accepted / drafted)


# ---------------------------------------------------------------------- output


COLUMNS = (
    ("workload", "workload", "{}"), ("system", "system", "{}"), ("requests", "completed", "{:d}"),
    ("errors", "errors", "{:d}"), ("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_throughput", "{:.1f}"),
    ("total tok/s", "total_token_throughput", "{:.0f}"), ("cache hit", "cache_hit_fraction", "{:.2f}"),
    ("TTFT mean/p50/p90/p99 ms", "ttft", None), ("TPOT mean/p50/p90/p99 ms", "tpot", None),
    ("ITL mean/p50/p90/p99 ms", "itl", None), ("TTFT warm/cold ms", "warm", None),
    ("draft accept", "spec", None),
)


def _cell(r: RunResult, key: str, fmt: str | None) -> str:
    m = r.metrics
    if key in ("workload", "system"):
        return getattr(r, key) + (f" ({r.note})" if key == "system" and r.note else "")
    if fmt is not None:
        value = m[key]
        return fmt.format(int(value)) if fmt == "{:d}" else fmt.format(value)
    if key == "warm":
        return f"{_ms(m['mean_ttft_warm_ms'])} / {_ms(m['mean_ttft_cold_ms'])}"
    if key == "spec":
        rate = m.get("spec_acceptance_rate")
        return "-" if rate is None else f"{rate:.2f} of {int(m['spec_draft_tokens'])}"
    return " / ".join(_ms(m[f"{s}_{key}_ms"]) for s in ("mean", "p50", "p90", "p99"))


def _ms(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0f}"


def markdown_table(runs: Sequence[RunResult]) -> str:
    """One row per run; the draft acceptance column only where some run drafted."""
    drafted = any("spec_acceptance_rate" in r.metrics for r in runs)
    columns = [c for c in COLUMNS if drafted or c[1] != "spec"]
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r, key, fmt) for _, key, fmt in columns) + " |" for r in runs]
    return "\n".join(lines)


def emit_json(result: dict[str, Any], path: Path) -> None:
    """Print a small benchmark's result and write it to `path` (bench/results/...)."""
    text = json.dumps(result, indent=2)
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_results(runs: Sequence[RunResult], path: Path, meta: dict[str, Any]) -> None:
    """`path` (JSON: meta + every run with its per-request records) and `path` with .md."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "runs": [r.to_json() for r in runs]}, indent=1, allow_nan=True))
    params = "\n".join(f"- `{r.workload}`: " + ", ".join(f"{k}={v}" for k, v in r.params.items())
                       for r in {r.workload: r for r in runs}.values())
    path.with_suffix(".md").write_text(f"{markdown_table(runs)}\n\nWorkloads:\n{params}\n")


def load_results(path: Path) -> tuple[dict[str, Any], list[RunResult]]:
    data = json.loads(Path(path).read_text())
    return data["meta"], [RunResult.from_json(r) for r in data["runs"]]


# ---------------------------------------------------------------------- CLI


def parse_sizes(items: Sequence[str]) -> dict[str, int]:
    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--size takes KEY=VALUE, not {item!r}")
        sizes[key.replace("-", "_")] = int(value)
    return sizes


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from radixserve.models.resolve import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model, weights=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server")
    target.add_argument("--launch", action="store_true", help="start `radixserve serve` for the run")
    add_model(parser, help="the tokenizer for the workload (and the model with --launch)",
              dtype_help="with --launch (auto: bf16 on CUDA and avx2+ CPUs, else fp32)")
    add_server_arg(parser, help="more `serve` options with --launch")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="repeatable; default: all")
    parser.add_argument("--size", action="append", default=[], help="workload size KEY=VALUE, e.g. docs=2 (repeatable)")
    parser.add_argument("--api", choices=APIS, default="generate")
    parser.add_argument("--served-model", help="the `model` field of OpenAI requests (default: left out)")
    add_load(parser)
    parser.add_argument("--rate", type=float, help="Poisson arrivals of first requests, requests/s")
    parser.add_argument("--system", default="", help="label for the table")
    add_out(parser, "bench/results/serving_run.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    sizes = parse_sizes(args.size)
    workloads = [build(name, tokenizer, seed=args.seed, **_sizes_for(name, sizes)) for name in args.workload or WORKLOADS]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(launch_server(args.model, "--dtype", args.dtype, *args.server_arg)).url
        runs = []
        for w in workloads:
            flush_cache(url)
            before = spec_counters(url)
            runs.append(asyncio.run(run_workload(
                url, w, api=args.api, concurrency=args.concurrency, rate=args.rate, seed=args.seed,
                system=args.system or ("radixserve " + " ".join(args.server_arg)).strip() if args.launch else args.system,
                model=args.served_model, progress=not args.no_progress,
            )))
            add_acceptance(runs[-1].metrics, before, spec_counters(url))
    print(markdown_table(runs))
    write_results(runs, args.out, {"argv": list(argv or sys.argv[1:])})
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0 if all(r.metrics["errors"] == 0 for r in runs) else 1


def _sizes_for(name: str, sizes: dict[str, int]) -> dict[str, int]:
    """The subset of `sizes` that workload `name` takes."""
    import inspect

    accepted = inspect.signature(WORKLOADS[name]).parameters
    return {k: v for k, v in sizes.items() if k in accepted}


if __name__ == "__main__":
    sys.exit(main())
