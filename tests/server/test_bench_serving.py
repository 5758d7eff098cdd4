"""The serving benchmark: metrics from synthetic records, the load generator against a real
tiny-model server, the transformers baselines, and the report (table + PNGs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import httpx
import pytest
from http_helpers import TINY_OPTIONS, running_server

from bench.serving import (
    RequestRecord,
    Slots,
    add_acceptance,
    flush_cache,
    load_results,
    markdown_table,
    percentile,
    run_workload,
    spec_counters,
    summarize,
    warm_flags,
    write_results,
)
from bench.workloads import build


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_summarize_synthetic_records():
    recs = [
        RequestRecord("d0", sent=0.0, ttft=1.0, itl=[0.1, 0.1, 0.1], e2e=1.3, prompt_tokens=100, cached_tokens=0, output_tokens=4),
        RequestRecord("d0", sent=1.5, ttft=0.2, itl=[0.2, 0.2, 0.2], e2e=0.8, prompt_tokens=100, cached_tokens=96, output_tokens=4),
        RequestRecord("d1", sent=0.5, ttft=0.5, itl=[], e2e=0.5, prompt_tokens=50, cached_tokens=0, output_tokens=1),
        RequestRecord("d1", sent=0.6, error="HTTP 500: boom"),
    ]
    assert recs[0].tpot == pytest.approx(0.1) and recs[1].tpot == pytest.approx(0.2)
    assert recs[2].tpot is None and recs[3].tpot is None
    # d0's second request was sent after the first one's first token (t=1.0); d1's first token came at 1.0
    assert warm_flags(recs) == [False, True, False, False]
    m = summarize(recs, duration=2.0)
    assert (m["completed"], m["errors"]) == (3, 1)
    assert m["output_throughput"] == pytest.approx(9 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((250 + 9) / 2.0)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["cache_hit_fraction"] == pytest.approx(96 / 250)
    assert m["mean_ttft_ms"] == pytest.approx(1000 * 1.7 / 3)
    assert m["p50_ttft_ms"] == pytest.approx(500)
    assert m["mean_tpot_ms"] == pytest.approx(150)
    assert m["mean_itl_ms"] == pytest.approx(150)
    assert m["mean_ttft_warm_ms"] == pytest.approx(200) and m["mean_ttft_cold_ms"] == pytest.approx(750)


def test_slots_serve_priority_then_order():
    async def scenario() -> list[str]:
        slots, order = Slots(1), []
        await slots.acquire(0)

        async def waiter(name: str, prio: int) -> None:
            await slots.acquire(prio)
            order.append(name)
            slots.release()

        tasks = [asyncio.create_task(waiter(n, p)) for n, p in (("root1", 0), ("root2", 0), ("child", -1))]
        await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["child", "root1", "root2"]


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("api", ["generate", "openai"])
def test_load_generator_against_a_real_server(server, tokenizer, api):
    flush_cache(server.url)
    rag = build("rag", tokenizer, docs=2, doc_tokens=64, questions=3, max_tokens=5, seed=0)
    run = asyncio.run(run_workload(server.url, rag, api=api, concurrency=2, system="tiny", progress=False))
    assert run.metrics["errors"] == 0 and run.metrics["completed"] == 6
    for r in run.requests:
        assert r.output_tokens == 5 and r.prompt_tokens > 64 and r.ttft is not None and r.e2e >= r.ttft
        assert 1 <= len(r.itl) <= 4
    assert run.metrics["cached_tokens"] > 0, "questions on a document computed before hit the cache"
    assert run.metrics["warm_requests"] > 0 and run.metrics["cold_requests"] > 0


def test_acceptance_rate_comes_from_the_servers_counters(server, tiny_dir, tokenizer, tmp_path):
    """A run's draft and accepted tokens are the growth of the server's /metrics counters over
    it, and the table shows their ratio; where nothing was drafted there is no such column."""
    quote = build("quote", tokenizer, docs=1, doc_tokens=64, questions=2, max_tokens=8, seed=0)
    before = spec_counters(server.url)
    plain = asyncio.run(run_workload(server.url, quote, concurrency=1, system="off", progress=False))
    assert before == spec_counters(server.url) == (0.0, 0.0)  # speculation is off there
    add_acceptance(plain.metrics, before, before)
    assert "spec_acceptance_rate" not in plain.metrics and "draft accept" not in markdown_table([plain])

    # a random model copies nothing by itself: a token the bias makes the argmax, repeated in
    # the prompt, gets drafted from the prompt (window 1) and every draft is accepted
    options = (*TINY_OPTIONS, "--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "1")
    body = {"input_ids": [1234] * 8, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "logit_bias": {"1234": 100}}}
    with running_server(tiny_dir, *options, log_dir=tmp_path) as spec:
        before = spec_counters(spec.url)
        httpx.post(spec.url + "/generate", json=body, timeout=60).raise_for_status()
        after = spec_counters(spec.url)
    metrics = dict(plain.metrics)
    add_acceptance(metrics, before, after)
    assert metrics["spec_draft_tokens"] == after[0] - before[0] > 0
    assert metrics["spec_accepted_tokens"] == metrics["spec_draft_tokens"] and metrics["spec_acceptance_rate"] == 1.0
    table = markdown_table([plain, dataclasses.replace(plain, system="on", metrics=metrics)])
    assert "draft accept" in table and f"| 1.00 of {int(metrics['spec_draft_tokens'])} |" in table


def test_follow_ups_carry_the_real_output(server, tokenizer):
    flush_cache(server.url)
    chat = build("chat", tokenizer, conversations=2, turns=3, first_tokens=40, turn_tokens=8, max_tokens=4, seed=0)
    run = asyncio.run(run_workload(server.url, chat, concurrency=4, rate=50.0, system="tiny", progress=False))
    assert run.metrics["completed"] == 6 and run.metrics["errors"] == 0
    by_conv: dict[str, list[RequestRecord]] = {}
    for r in run.requests:
        by_conv.setdefault(r.group, []).append(r)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.sent)
        for a, b in zip(turns, turns[1:]):
            assert b.sent >= a.sent + a.e2e - 1e-6, "a turn waits for the previous one"
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens
            assert b.cached_tokens > 0


def test_baselines_results_and_report(server, tiny_dir, tokenizer, tmp_path):
    import torch

    from bench.baselines import HFBaseline
    from bench.report import make_report

    flush_cache(server.url)
    unique = build("unique", tokenizer, requests=3, prompt_tokens=24, max_tokens=4, seed=0)
    ours = asyncio.run(run_workload(server.url, unique, concurrency=3, system="radixserve", progress=False))
    hf = HFBaseline(str(tiny_dir), torch.float32)
    one = hf.one_at_a_time(unique, limit=2, progress=False)
    static = hf.static_batched(unique, 3, progress=False)
    assert one.note == "2 of 3 requests" and one.metrics["completed"] == 2
    assert all(r.output_tokens == 4 and r.prompt_tokens == p.prompt_tokens
               for r, p in zip(one.requests + static.requests, ours.requests * 2, strict=False))
    assert [r.output for r in one.requests] == [r.output for r in ours.requests[:2]], "same greedy tokens (fp32)"

    path = tmp_path / "serving.json"
    write_results([ours, one, static], path, {"model": "tiny", "dtype": "float32"})
    meta, runs = load_results(path)
    assert meta["model"] == "tiny" and [r.system for r in runs] == ["radixserve", "transformers one-at-a-time",
                                                                    "transformers static batching"]
    assert runs[0].requests[0].ttft == ours.requests[0].ttft
    assert "| unique | radixserve |" in path.with_suffix(".md").read_text()
    json.loads(path.read_text())

    report = make_report(path, tmp_path / "out")
    text = report.read_text()
    assert "## Targets" in text and "unique: output tok/s, radixserve / transformers static batching" in text
    for name in ("throughput", "ttft", "ttft_cdf", "tpot_cdf"):
        png = tmp_path / "out" / f"serving_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png.name})" in text
