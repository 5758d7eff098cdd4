"""Head-of-line blocking: how long short requests wait beside a long prompt's chunked prefill.

One server; first, each short request alone (the baseline), then a long prompt (a real
document of `--long-tokens` tokens, one output token) and, once its prefill is under way,
the same short requests, one after another. The ratio of their time to first token beside
the long prefill to the time alone is the figure: 1.0 would be no cost at all, and a
scheduler that lets a long prefill take every step's budget makes it about the long
prompt's whole prefill time divided by a short request's.

Then the same for a request that is decoding: a plain stream alone, then a stream that runs
through the long prompt's whole prefill, and the gaps between its tokens while that prefill
runs. Every step waits for the step's prefill chunk, so its worst gap is the costliest chunk's
step: without counting attention, the chunks deep in the long context.

    python -m bench.head_of_line --model default --dtype float32
"""

from __future__ import annotations

import datetime
import statistics
import threading
import time
from collections.abc import Sequence

import httpx

from bench.common import add_model, add_out, flush_cache, launch_server, new_parser
from bench.corpus import documents
from bench.model_runner import machine
from bench.serving import emit_json, load_tokenizer
from radixserve.kernels import isa

SHORT_PROMPTS = ["Hello", "Name a colour.", "Count to three.", "What is two plus two?", "Say hi.", "One word: yes"]


def ttft(client: httpx.Client, text: str, max_new_tokens: int = 1) -> float:
    """Seconds from sending to the first streamed token."""
    body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    start = time.perf_counter()
    with client.stream("POST", "/generate", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def stream_times(client: httpx.Client, max_new_tokens: int, started: threading.Event | None = None) -> list[float]:
    """Arrival times (perf_counter) of a greedy stream's chunks; `started` is set at its first."""
    body = {"text": "Write a long story about a lighthouse.", "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    times: list[float] = []
    with client.stream("POST", "/generate", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if started is not None:
                    started.set()
    return times


def gaps_within(times: list[float], start: float, end: float) -> list[float]:
    """Seconds between consecutive chunks, of the gaps that end within [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if start <= b <= end]


def measure_stream(url: str, long_text: str, stream_tokens: int) -> dict[str, object]:
    """A decoding stream's token gaps alone, then while the long prompt's prefill runs."""
    with httpx.Client(base_url=url, timeout=600) as client:
        alone = gaps_within(stream_times(client, stream_tokens), 0.0, float("inf"))
        flush_cache(url)
        started, times = threading.Event(), []

        def stream() -> None:
            with httpx.Client(base_url=url, timeout=600) as c:
                times.extend(stream_times(c, stream_tokens, started))

        thread = threading.Thread(target=stream)
        thread.start()
        started.wait(60)
        sent = time.perf_counter()
        long_ttft = ttft(client, long_text)
        thread.join()
    beside = sorted(gaps_within(times, sent, sent + long_ttft))
    if not beside or times[-1] < sent + long_ttft:
        raise RuntimeError(f"the stream ended before the long prefill did: raise --stream-tokens ({stream_tokens})")
    return {
        "stream_gap_alone_ms": 1000 * statistics.median(alone),
        "stream_gap_beside_long_median_ms": 1000 * statistics.median(beside),
        "stream_gap_beside_long_worst_ms": 1000 * beside[-1],
        "stream_gaps_beside_long": len(beside),
        "long_ttft_with_stream_s": long_ttft,
    }


def measure(url: str, long_text: str, repeats: int) -> dict[str, object]:
    with httpx.Client(base_url=url, timeout=600) as client:
        alone = [ttft(client, p) for _ in range(repeats) for p in SHORT_PROMPTS]
        flush_cache(url)
        long_result: dict[str, float] = {}

        def send_long() -> None:
            with httpx.Client(base_url=url, timeout=600) as c:
                long_result["ttft"] = ttft(c, long_text)

        thread = threading.Thread(target=send_long)
        thread.start()
        time.sleep(0.5)  # its prefill is under way
        beside = []
        while thread.is_alive() and len(beside) < len(SHORT_PROMPTS) * repeats:
            beside.append(ttft(client, SHORT_PROMPTS[len(beside) % len(SHORT_PROMPTS)]))
        thread.join()
    return {
        "short_ttft_alone_s": statistics.median(alone),
        "short_ttft_beside_long_s": statistics.median(beside) if beside else None,
        "short_requests_beside_long": len(beside),
        "long_ttft_s": long_result["ttft"],
        "ratio": statistics.median(beside) / statistics.median(alone) if beside else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model(parser)
    parser.add_argument("--long-tokens", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=512,
                        help="the decoding stream's length: it must outlast the long prompt's prefill")
    add_out(parser, "bench/results/head_of_line.json")
    args = parser.parse_args(argv)
    long_text = documents(load_tokenizer(args.model), 1, args.long_tokens)[0]
    with launch_server(args.model, "--dtype", args.dtype) as server:
        result = measure(server.url, long_text, args.repeats)
        flush_cache(server.url)
        result.update(measure_stream(server.url, long_text, args.stream_tokens))
    result.update(model=args.model, dtype=args.dtype, long_tokens=args.long_tokens, cpu_isa=str(isa.selected_tier()),
                  cpu=machine(), date=datetime.date.today().isoformat())
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
