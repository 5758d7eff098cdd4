"""The scheduler's decisions, driven without processes by a fake worker.

The fake worker mirrors page tables from the scheduler's diffs (with the real `PageTable`),
checks that every chunk's pages are assigned, and "samples" a token that depends only on the
previous token and its position, so outputs must not depend on batching, chunking, caching
or retraction.
"""

from __future__ import annotations

import pytest

from radixserve.config import ServerConfig
from radixserve.protocol import (
    ChunkResult,
    ForwardBatch,
    ForwardResult,
    PinDone,
    PinPrefix,
    RequestOutput,
    RequestRejected,
    ResumedSample,
    SamplingParams,
    TokenBatchOut,
    TokenizedRequest,
    WorkerInfo,
    WorkerReady,
)
from radixserve.scheduler.core import Scheduler
from radixserve.worker.page_table import PageTable

EOS = 2


def fake_token(prev: int, pos: int) -> int:
    return (prev * 31 + pos * 7) % 997 + 3  # never EOS


class FakeWorker:
    def __init__(self, rows: int, pages_per_row: int, page_size: int) -> None:
        self.table = PageTable(rows, pages_per_row)
        self.page_size = page_size
        self.steps: list[ForwardBatch] = []

    def step(self, batch: ForwardBatch) -> ForwardResult:
        self.steps.append(batch)
        for row in batch.released:
            self.table.release(row)
        for row, pages in batch.assigned:
            self.table.assign(row, pages)
        for row, pages in batch.appended:
            self.table.append(row, pages)
        results = []
        for c in batch.chunks:
            end = c.prefix_len + len(c.token_ids)
            assert self.table.num_pages(c.row) * self.page_size >= end
            res = ChunkResult()
            if c.draft_len:  # verify as the real worker does: draw after each position in turn
                first = len(c.token_ids) - c.draft_len - 1
                for j in range(first, len(c.token_ids)):
                    token = fake_token(c.token_ids[j], c.prefix_len + j)
                    if j == len(c.token_ids) - 1 or token != c.token_ids[j + 1]:
                        res.next_token_id = token
                        break
                    res.accepted_ids.append(token)
            elif c.sample:
                res.next_token_id = fake_token(c.token_ids[-1], end - 1)
            if c.input_logprobs_from >= 0:  # as many as the real worker returns
                targets = len(c.token_ids) - c.input_logprobs_from - 1 + (not c.sample and c.next_token_id >= 0)
                res.input_logprobs = [-1.0] * targets
            results.append(res)
        return ForwardResult(results, 0.0)


def make(page_size: int = 4, pages: int = 256, context_token_cost: float = 0.0, **options) -> tuple[Scheduler, FakeWorker]:
    config = ServerConfig(page_size=page_size, debug_checks=True, **options)
    ready = WorkerReady(WorkerInfo(pages, page_size, pages * page_size, 1000, [EOS], "fake", "float32", "cpu", "avx2",
                                   context_token_cost=context_token_cost))
    sched = Scheduler(config, ready, lambda req: None)
    return sched, FakeWorker(config.max_running_requests, pages, page_size)


def take_outputs(sched: Scheduler) -> list[RequestOutput]:
    """The samples' outputs among what the scheduler has for the front (`take_messages`)."""
    return [out for m in sched.take_messages() if isinstance(m, TokenBatchOut) for out in m.outputs]


_RIDS: dict[str, int] = {}


def rid(name: str) -> int:
    """Tests name their requests; on the wire a request's id is the int the front assigned."""
    return _RIDS.setdefault(name, len(_RIDS))


def key(name: str, index: int = 0) -> str:
    """The worker's name for a sample (`Request.key`)."""
    return f"{rid(name)}#{index}"


def request(name: str, ids: list[int], max_new: int = 5, **kw) -> TokenizedRequest:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw.pop("sp", {}))
    return TokenizedRequest(rid(name), ids, sampling, **kw)


def run(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000) -> dict[tuple[str, int], dict]:
    """Step until idle; return each sample's tokens, cached count and finish reason, by name."""
    names = {v: k for k, v in _RIDS.items()}
    done: dict[tuple[str, int], dict] = {}
    for _ in range(max_steps):
        batch = sched.build_batch()
        if batch is not None:
            sched.process_result(worker.step(batch))
        for out in take_outputs(sched):
            d = done.setdefault((names[out.rid], out.index), {"tokens": [], "cached": out.cached_tokens, "input_logprobs": []})
            d["tokens"] += out.new_token_ids
            d["input_logprobs"] += out.input_logprobs
            if out.finish is not None:
                d["finish"] = out.finish
        if batch is None:
            break
    assert not sched.has_work
    sched.kv.check([])
    assert sched.kv.allocator.num_free + sched.kv.cache.stats().cached_pages == sched.kv.total_pages
    return done


def expected_tokens(ids: list[int], n: int) -> list[int]:
    out, prev, pos = [], ids[-1], len(ids) - 1
    for _ in range(n):
        prev = fake_token(prev, pos)
        out.append(prev)
        pos += 1
    return out


def test_outputs_and_cached_tokens():
    sched, worker = make()
    prompt = list(range(10, 40))  # 30 tokens
    sched.add_request(request("a", prompt))
    first = run(sched, worker)
    sched.add_request(request("b", prompt))
    second = run(sched, worker)
    assert first["a", 0]["tokens"] == second["b", 0]["tokens"] == expected_tokens(prompt, 5)
    assert first["a", 0]["cached"] == 0
    assert second["b", 0]["cached"] == 28  # (30 - 1) // 4 * 4: the last token is always computed
    assert second["b", 0]["finish"].type == "length"


def test_chunked_prefill_respects_the_token_budget():
    sched, worker = make(chunk_size=8)
    sched.add_request(request("a", list(range(100, 150))))
    sched.add_request(request("b", list(range(200, 230))))
    done = run(sched, worker)
    for batch in worker.steps:
        prefill = sum(len(c.token_ids) for c in batch.chunks if len(c.token_ids) > 1 or c.prefix_len == 0)
        assert prefill <= 8
    assert done["a", 0]["tokens"] == expected_tokens(list(range(100, 150)), 5)


def run_steps(sched: Scheduler, worker: FakeWorker, arrivals: dict[int, list]) -> tuple[dict[int, int], list[int]]:
    """Step until idle, adding `arrivals[step]` before that step; return each rid's first-token
    step and the tokens computed in every step."""
    first_token, step_tokens = {}, []
    for step in range(10_000):
        for msg in arrivals.get(step, []):
            assert sched.add_request(msg) is None
        batch = sched.build_batch()
        if batch is None:
            break
        step_tokens.append(sum(len(c.token_ids) for c in batch.chunks))
        sched.process_result(worker.step(batch))
        for out in take_outputs(sched):
            if out.new_token_ids:
                first_token.setdefault(out.rid, step)
    sched.kv.check([])
    assert sched.kv.allocator.num_free + sched.kv.cache.stats().cached_pages == sched.kv.total_pages
    return first_token, step_tokens


def test_a_short_request_is_not_stuck_behind_a_long_chunked_prefill():
    """While a long prompt's chunked prefill runs, a share of each step's budget goes to short
    prompts: one that arrives mid-prefill gets its first token at once, not after the long one."""
    sched, worker = make(chunk_size=64, pages=1024)
    arrivals = {0: [request("long", list(range(100, 1100)))], 2: [request("short", list(range(3000, 3010)))]}
    first_token, _ = run_steps(sched, worker, arrivals)
    assert first_token[rid("short")] == 2
    assert first_token[rid("long")] >= 15  # 1000 tokens at 54 to 64 a step: not delayed either


def test_long_prefills_keep_most_of_the_budget_while_short_ones_stream_in():
    """Neither side starves: short arrivals every step cannot stop a long prefill."""
    sched, worker = make(chunk_size=64, pages=2048, max_running_requests=64)
    arrivals = {step: [request(f"s{step}", list(range(4000 + 12 * step, 4000 + 12 * step + 12)))] for step in range(1, 40)}
    arrivals[0] = [request("long2", list(range(100, 1100)))]
    first_token, _ = run_steps(sched, worker, arrivals)
    assert first_token[rid("long2")] <= 1000 // 48 + 2  # at least 3/4 of every step
    assert all(first_token[rid(f"s{step}")] == step for step in range(1, 40))


def test_the_whole_budget_goes_to_one_long_prefill_when_nothing_else_waits():
    sched, worker = make(chunk_size=16, pages=512)
    _, step_tokens = run_steps(sched, worker, {0: [request("alone", list(range(100, 400)))]})
    assert step_tokens[:19] == [16] * 18 + [12]  # 300 = 18 * 16 + 12


def test_chunks_deep_in_a_long_prompt_shorten_so_no_step_outworks_a_first_chunk():
    """With the worker's attention cost (a tiny model's shape: attention equals its linear layers
    at 320 tokens of context), a long prompt's chunks shorten as its context grows, every step's
    prompt work stays within that of the prompt's first chunk, and the tokens are the same."""
    a = 1 / 320
    sched, worker = make(chunk_size=64, pages=1024, context_token_cost=a)
    prompt = list(range(100, 2100))
    sched.add_request(request("deep", prompt))
    sched.add_request(request("beside", list(range(3000, 3010)), max_new=200))  # decodes throughout
    done = run(sched, worker)
    assert done["deep", 0]["tokens"] == expected_tokens(prompt, 5)

    def work(start: int, n: int) -> float:
        return n + a * (n * start + n * (n + 1) / 2)

    first = work(0, 64)
    prefills = [[c for c in batch.chunks if len(c.token_ids) > 1] for batch in worker.steps]
    lengths = [len(c.token_ids) for chunks in prefills for c in chunks if c.rid == key("deep")]
    assert lengths[0] == 64 and lengths[-2] < 64 / 4  # the last one is what is left
    assert sum(lengths) == len(prompt)
    for chunks in prefills:
        assert sum(work(c.prefix_len, len(c.token_ids)) for c in chunks) <= first + 1e-6


def test_pages_of_a_chunked_prefill_count_as_in_use_not_as_evictable():
    """A chunked prefill publishes its pages to the cache as it goes; they are still in use."""
    sched, worker = make(chunk_size=16, pages=512)
    sched.add_request(request("long", list(range(100, 400))))
    for _ in range(10):
        sched.process_result(worker.step(sched.build_batch()))
        stats = sched.stats(0)
        assert stats.cached_pages > 0
        assert stats.running_pages >= stats.cached_pages  # every page so far, cached or not
        assert stats.free_pages + stats.evictable_pages + stats.running_pages == stats.total_pages
    run(sched, worker)
    stats = sched.stats(0)
    assert stats.running_pages == 0 and stats.evictable_pages == stats.cached_pages > 0


def test_lpm_admits_the_longest_cached_prefix_first():
    sched, worker = make(max_running_requests=1)
    doc = list(range(500, 540))
    sched.add_request(request("warm", doc + [1]))
    run(sched, worker)
    sched.add_request(request("cold", list(range(700, 741))))
    sched.add_request(request("hot", doc + [9]))
    batch = sched.build_batch()
    assert [c.rid for c in batch.chunks] == [key("hot")]


def test_lpm_deduplicates_a_burst_over_a_new_document():
    sched, worker = make()
    doc = list(range(300, 364))  # 64 uncached tokens shared by all
    for i in range(4):
        sched.add_request(request(f"q{i}", doc + [900 + i, 901 + i]))
    first = sched.build_batch()
    assert [c.rid for c in first.chunks] == [key("q0")]  # the others wait for q0's pages
    sched.process_result(worker.step(first))
    take_outputs(sched)
    done = run(sched, worker)
    assert all(done[f"q{i}", 0]["cached"] == 64 for i in range(1, 4))


def test_fcfs_does_not_wait():
    sched, worker = make(schedule_policy="fcfs")
    doc = list(range(300, 364))
    for i in range(3):
        sched.add_request(request(f"q{i}", doc + [900 + i]))
    assert len(sched.build_batch().chunks) == 3


def test_tiny_pool_retracts_and_outputs_do_not_change():
    prompts = [list(range(100 * i, 100 * i + 9 + i)) for i in range(1, 9)]
    roomy, w1 = make(pages=512)
    tight, w2 = make(pages=24)
    for s in (roomy, tight):
        for i, p in enumerate(prompts):
            s.add_request(request(f"r{i}", p, max_new=30, sp={"ignore_eos": True}))
    a, b = run(roomy, w1), run(tight, w2)
    assert tight.counters.retractions > 0
    assert {k: v["tokens"] for k, v in a.items()} == {k: v["tokens"] for k, v in b.items()}
    assert all(len(v["tokens"]) == 30 for v in b.values())


def test_abort_waiting_and_running_requests_frees_pages():
    sched, worker = make(max_running_requests=1)
    sched.add_request(request("run", list(range(10, 30)), max_new=100))
    sched.add_request(request("wait", list(range(40, 60)), max_new=100))
    sched.process_result(worker.step(sched.build_batch()))
    sched.abort(rid("wait"))
    sched.abort(rid("run"))
    done = run(sched, worker)
    assert done["wait", 0]["finish"].type == "abort"
    assert done["run", 0]["finish"].type == "abort"


def test_full_queue_and_oversized_prompt_are_rejected():
    sched, _ = make(pages=8, max_queued_requests=2)
    assert sched.add_request(request("a", [5, 6])) is None
    assert sched.add_request(request("b", [5, 6])) is None
    full = sched.add_request(request("c", [5, 6]))
    assert isinstance(full, RequestRejected) and full.retryable
    sched, _ = make(pages=8)
    big = sched.add_request(request("d", list(range(3, 40))))  # 37 tokens > 8 pages x 4
    assert isinstance(big, RequestRejected) and not big.retryable and "does not fit" in big.message


def test_n_samples_share_prompt_pages_and_get_distinct_seeds():
    sched, worker = make()
    sched.add_request(request("n", list(range(10, 30)), sp={"n": 3, "seed": 7}))
    seeds = [r.sampling.seed for r in sched.waiting]
    assert seeds == [7, 8, 9]
    done = run(sched, worker)
    assert [done["n", i]["cached"] for i in range(3)] == [0, 16, 16]


def test_stop_token_ids_and_min_new_tokens():
    prompt = list(range(10, 20))
    tokens = expected_tokens(prompt, 6)
    sched, worker = make()
    sched.add_request(request("a", prompt, max_new=6, sp={"stop_token_ids": [tokens[1]]}))
    sched.add_request(request("b", prompt, max_new=6, sp={"stop_token_ids": [tokens[1]], "min_new_tokens": 3}))
    done = run(sched, worker)
    assert done["a", 0]["tokens"] == tokens[:2]
    assert done["a", 0]["finish"].matched == tokens[1]
    assert done["b", 0]["tokens"] == tokens and done["b", 0]["finish"].type == "length"


@pytest.mark.parametrize("start", [0, 5, 13])
def test_prompt_logprob_chunks_cover_every_requested_position(start):
    sched, worker = make(chunk_size=4)
    prompt = list(range(50, 64))  # 14 tokens
    sched.add_request(request("warm", prompt, max_new=1))
    run(sched, worker)
    sched.add_request(request("lp", prompt, max_new=0, return_logprob=True, logprob_start_len=start))
    covered = []
    for _ in range(20):
        batch = sched.build_batch()
        if batch is None:
            break
        for c in batch.chunks:
            if c.input_logprobs_from >= 0:
                first = c.prefix_len + c.input_logprobs_from
                last = c.prefix_len + len(c.token_ids) - (0 if c.next_token_id >= 0 else 1)
                covered += list(range(first, last))  # positions whose next token gets scored
        sched.process_result(worker.step(batch))
    assert covered == list(range(max(start, 1) - 1, len(prompt) - 1))


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
def test_prompt_logprobs_with_n_are_computed_once(cache):
    """n samples with prompt logprobs each computed the whole prompt and its logprobs (0 cached
    tokens). Now sample 0 computes them once; the others wait for it, then hit its pages."""
    sched, worker = make(disable_radix_cache=not cache)
    prompt = list(range(10, 50))  # 40 tokens
    sched.add_request(request("plp", prompt, max_new=3, sp={"n": 3}, return_logprob=True, logprob_start_len=0))
    done = run(sched, worker)
    scored = {c.rid for b in worker.steps for c in b.chunks if c.input_logprobs_from >= 0}
    assert scored == {key("plp", 0)}
    assert len(done["plp", 0]["input_logprobs"]) == 40  # None for the first token, then 39
    assert done["plp", 1]["input_logprobs"] == done["plp", 2]["input_logprobs"] == []  # the front shares them
    computed = [sum(len(c.token_ids) for b in worker.steps for c in b.chunks if c.rid == key("plp", i)) for i in range(3)]
    shared = 36 if cache else 0  # (40 - 1) // 4 * 4
    assert [done["plp", i]["cached"] for i in range(3)] == [0, shared, shared]
    assert computed == [40 + 2, 40 - shared + 2, 40 - shared + 2]  # prompt, then 2 decode steps
    assert all(done["plp", i]["tokens"] == expected_tokens(prompt, 3) for i in range(3))


def test_samples_wait_for_sample_0s_prompt_logprobs_across_its_retraction():
    sched, worker = make(chunk_size=8)
    prompt = list(range(10, 30))  # 20 tokens: three chunks
    sched.add_request(request("plp", prompt, max_new=3, sp={"n": 2}, return_logprob=True, logprob_start_len=0))
    sched.process_result(worker.step(sched.build_batch()))
    sched._retract(next(r for r in sched.running if r.index == 0))  # as when pages run out
    done = run(sched, worker)
    steps = [{c.rid: c for c in b.chunks} for b in worker.steps]
    first_sampled = next(i for i, b in enumerate(steps) if key("plp", 0) in b and b[key("plp", 0)].sample)
    assert all(key("plp", 1) not in b for b in steps[: first_sampled + 1])
    assert len(done["plp", 0]["input_logprobs"]) == 20 and done["plp", 1]["input_logprobs"] == []
    assert done["plp", 1]["cached"] == 16
    assert done["plp", 1]["tokens"] == done["plp", 0]["tokens"] == expected_tokens(prompt, 3)


def test_a_resumed_request_continues_from_its_outputs_on_a_fresh_scheduler():
    """After an engine restart the front resubmits unfinished samples with their outputs so far
    (`TokenizedRequest.resume`): the new scheduler computes prompt + outputs and goes on, with
    `max_new_tokens` counting the earlier ones, the first engine's `cached_tokens`, and the
    outputs given to the worker (penalties, a seeded sample's step)."""
    prompt = list(range(10, 40))
    whole = expected_tokens(prompt, 12)
    sched, worker = make(chunk_size=16)
    groups = [whole[:1], whole[1:4], whole[4:5]]  # as the front received them
    msg = request("resumed", prompt, max_new=12, sp={"n": 2},
                  resume=[ResumedSample(1, groups, cached_tokens=20)])
    assert sched.add_request(msg) is None
    done = run(sched, worker)
    assert list(done) == [("resumed", 1)]  # sample 0 had finished: only sample 1 comes back
    assert done["resumed", 1]["tokens"] == whole[5:] and done["resumed", 1]["cached"] == 20
    assert done["resumed", 1]["finish"].type == "length"
    new = [n for b in worker.steps for n in b.new_requests]
    assert [(n.rid, n.output_ids) for n in new] == [(key("resumed", 1), whole[:5])]
    assert sched.counters.prompt_tokens == 0  # the first engine counted it


def test_a_crash_suspect_runs_alone_until_it_samples():
    """`isolate`: the suspect's steps hold nothing else, so a second failure names it alone;
    once it has sampled a token it is batched like any request."""
    sched, worker = make(chunk_size=8)
    sched.add_request(request("busy", list(range(100, 110)), max_new=40))
    for _ in range(3):
        sched.process_result(worker.step(sched.build_batch()))
    sched.add_request(request("suspect", list(range(200, 220)), max_new=6, isolate=True))
    done = run(sched, worker)
    keys = [{c.rid for c in b.chunks} for b in worker.steps[3:]]
    alone = [k for k in keys if key("suspect") in k]
    first_sample = next(i for i, k in enumerate(keys) if key("suspect") in k and len(k) > 1)
    assert all(k == {key("suspect")} for k in keys[:first_sample] if key("suspect") in k)
    assert len([k for k in keys[:first_sample] if k == {key("suspect")}]) == 3  # 20 tokens in chunks of 8
    assert len(alone) > 3  # then batched with the other
    assert done["suspect", 0]["tokens"] == expected_tokens(list(range(200, 220)), 6)
    assert done["busy", 0]["tokens"] == expected_tokens(list(range(100, 110)), 40)


def test_isolated_samples_of_one_request_all_get_their_turn():
    """Both samples of an isolated request with prompt logprobs finish: sample 1 waits for
    sample 0's prompt logprobs, and each runs alone until it samples."""
    sched, worker = make()
    prompt = list(range(300, 320))
    sched.add_request(request("iso", prompt, max_new=4, sp={"n": 2}, isolate=True,
                              return_logprob=True, logprob_start_len=0))
    done = run(sched, worker, max_steps=200)
    assert done["iso", 0]["tokens"] == done["iso", 1]["tokens"] == expected_tokens(prompt, 4)
    assert len(done["iso", 0]["input_logprobs"]) == len(prompt)
    first_samples = [i for i, b in enumerate(worker.steps) if any(c.sample for c in b.chunks)][:2]
    assert all(len(b.chunks) == 1 for b in worker.steps[: first_samples[1] + 1])


def _quoting_prompt(length: int, quote: int) -> tuple[list[int], list[int]]:
    """A prompt whose output (which depends only on its last token and its length) already
    stands in it, after an earlier copy of its last two tokens: a quote the drafter finds."""
    end = [501, 502]
    out = expected_tokens([0] * (length - 1) + [end[-1]], quote)
    body = end + out
    prompt = body + list(range(600, 600 + length - len(body) - len(end))) + end
    assert len(prompt) == length
    return prompt, out


def test_speculation_gives_the_same_tokens_in_fewer_steps():
    prompt, quoted = _quoting_prompt(60, 12)
    want = expected_tokens(prompt, 20)
    assert want[:12] == quoted
    plain_sched, plain_worker = make(chunk_size=64)
    plain_sched.add_request(request("plain", prompt, max_new=20))
    plain = run(plain_sched, plain_worker)
    sched, worker = make(chunk_size=64, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    sched.add_request(request("spec", prompt, max_new=20))
    done = run(sched, worker)
    assert done["spec", 0]["tokens"] == plain["plain", 0]["tokens"] == want
    assert done["spec", 0]["finish"].type == "length"
    assert sched.counters.spec_accepted_tokens >= 8  # the quote, drafted 4 at a time
    assert len(worker.steps) < len(plain_worker.steps) - 5
    assert sched.counters.spec_draft_tokens >= sched.counters.spec_accepted_tokens


@pytest.mark.parametrize("at", [1, 3, 6])
def test_a_stop_inside_an_accepted_draft_ends_there(at):
    prompt, quoted = _quoting_prompt(60, 12)
    stop = quoted[at]
    for options in ({}, {"speculative_algorithm": "ngram"}):
        sched, worker = make(chunk_size=64, **options)
        sched.add_request(request("stop", prompt, max_new=20, sp={"stop_token_ids": [stop]}))
        sched.add_request(request("short", prompt, max_new=at + 1))
        done = run(sched, worker)
        assert done["stop", 0]["tokens"] == quoted[: quoted.index(stop) + 1], options
        assert done["stop", 0]["finish"].type == "stop"
        assert done["short", 0]["tokens"] == quoted[: at + 1] and done["short", 0]["finish"].type == "length"


def test_a_request_whose_drafts_are_always_rejected_pauses_longer_each_time():
    """Every token the fake worker outputs stands once in this prompt, so with 1-token windows
    a draft is found at every step (the tokens after it in the prompt), and the fake model never
    continues the prompt: every draft is rejected. The request pauses for 1, 2, 4, 8, ... decode
    steps after its drafts' rate falls: a few drafts in its 60 tokens, not one per step, and
    still one now and then."""
    prompt = list(range(3, 1000))
    sched, worker = make(pages=512, chunk_size=1024, speculative_algorithm="ngram",
                         speculative_ngram_min_match_window_size=1)
    sched.add_request(request("r", prompt, max_new=60))
    done = run(sched, worker)
    assert done["r", 0]["tokens"] == expected_tokens(prompt, 60)
    assert sched.counters.spec_accepted_tokens == 0
    drafting = [i for i, b in enumerate(worker.steps) if any(c.draft_len for c in b.chunks)]
    assert [b - a for a, b in zip(drafting, drafting[1:])] == [1, 1, 1, 2, 3, 5, 9, 17]
    assert sched.counters.spec_draft_tokens == 18  # 2 tokens each: no draft was ever accepted to grow it
    assert len(worker.steps) == 1 + 59  # the prefill, then one step per token


def test_draft_pace_grows_from_two_tokens_backs_off_while_drafts_fail_and_resumes():
    from radixserve.scheduler.draft_pace import DraftPace

    pace = DraftPace(8)
    assert pace.allow() == 2  # a first draft is two tokens: its check is cheap
    pace.record(2, 2)  # accepted whole: the length doubles (to the cap, 8)
    assert pace.allow() == 4
    pace.record(4, 4)
    assert pace.allow() == 8
    pace.record(8, 8)
    assert pace.allow() == 8
    pace.record(8, 5)  # rejected after 5: the next draft is the accepted part + 1
    assert pace.allow() == 6
    pace.record(6, 0)  # rejected at once: two tokens, not one; the rate (0.41) still drafts
    assert pace.allow() == 2
    for _ in range(2):  # 0.2, 0.1: drafting on
        pace.record(2, 0)
        assert pace.allow() == 2
    pace.record(2, 0)  # 0.05: one step paused
    assert [pace.allow() for _ in range(2)] == [0, 2]
    pace.record(2, 0)  # again: two steps
    assert [pace.allow() for _ in range(3)] == [0, 0, 2]
    pace.record(2, 2)  # accepted: the rate is back up, no pause, and the length grows again
    assert [pace.allow() for _ in range(2)] == [4, 4]
    pace.record(4, 0)  # one rejection after a good run: no pause
    assert pace.allow() == 2
    for _ in range(12):  # a long failing run: pauses double up to the cap
        pace.record(2, 0)
        paused = 0
        while not pace.allow():
            paused += 1
    assert paused == 64


# ---------------------------------------------------------------------- pins


def document(seed: int, n: int) -> list[int]:
    """Token ids of a document that shares no page with another seed's."""
    return [1000 + seed * 1000 + i for i in range(n)]


def run_pins(sched: Scheduler, worker: FakeWorker) -> dict[int, PinDone]:
    """Step until idle; return the pin replies by order id."""
    replies: dict[int, PinDone] = {}
    for _ in range(10_000):
        batch = sched.build_batch()
        if batch is not None:
            sched.process_result(worker.step(batch))
        replies.update({m.req_id: m for m in sched.take_messages() if isinstance(m, PinDone)})
        if batch is None:
            break
    assert not sched.has_work
    return replies


def computed(worker: FakeWorker, tokens: list[int]) -> bool:
    """Whether any chunk the worker ran holds one of `tokens`."""
    return any(set(c.token_ids) & set(tokens) for batch in worker.steps for c in batch.chunks)


def test_pins_count_against_the_queue_limit_and_are_refused_before_queueing():
    """A pin is a prefill like any prompt: beyond --max-queued-requests it gets the retryable
    refusal a request gets (503 overloaded), and nothing of it is queued."""
    sched, worker = make(max_queued_requests=2)
    assert sched.add_request(request("queued", [5, 6, 7])) is None
    assert sched.pin(PinPrefix(1, document(1, 16))) is None
    assert sched.add_request(request("refused", [5, 6, 7])).retryable
    full = sched.pin(PinPrefix(2, document(2, 16)))
    assert full is not None and full.pin is None and full.refusal == "queue_full", full
    assert "queue is full" in full.error
    assert len(sched.waiting) == 2
    replies = run_pins(sched, worker)
    assert replies[1].pin is not None and not computed(worker, document(2, 16))


def test_a_pin_over_the_budget_counting_pins_being_made_is_refused_before_any_prefill():
    """The budget counts the pages of pins held and of pins still queued or computing: a pin
    that cannot fit is refused at once, not after a prefill of its prefix. A pin that shares
    pages with one being made needs only its own."""
    sched, worker = make(pages=64)  # pins may hold 32 pages of 4 tokens
    first, second = document(1, 80), document(2, 80)  # 20 pages each
    assert sched.pin(PinPrefix(1, first)) is None
    over = sched.pin(PinPrefix(2, second))
    assert over is not None and over.pin is None and over.refusal == "refused", over
    assert "pin budget" in over.error and "--max-pinned-fraction" in over.error
    longer = first + document(3, 8)  # 20 pages shared with the first, 2 of its own
    assert sched.pin(PinPrefix(3, longer)) is None
    replies = run_pins(sched, worker)
    assert replies[1].pin.tokens == 80 and replies[3].pin.tokens == 88, replies
    assert not computed(worker, second)
    assert sched.pins.pinned_tokens("memory") == 88


def test_each_tenant_has_a_share_of_the_pin_budget_and_a_bound_on_pins_in_flight():
    """One tenant can neither take the whole pin budget nor queue more than a few pins: beyond
    its share a pin is refused at once (409), beyond its bound on pins in flight it is told to
    retry (429); another tenant pins meanwhile."""
    sched, worker = make(pages=128, max_pinned_share_per_tenant=0.5, max_pins_in_flight_per_tenant=2)
    # pins may hold 64 pages, one tenant 32; each document is 12 pages
    def order(req_id: int, tenant: str, seed: int) -> PinPrefix:
        return PinPrefix(req_id, document(seed, 48), cache_salt=tenant, tenant=tenant)

    assert sched.pin(order(1, "alpha", 1)) is None
    assert sched.pin(order(2, "alpha", 2)) is None
    busy = sched.pin(order(3, "alpha", 3))
    assert busy is not None and busy.refusal == "pins_in_flight", busy
    assert "--max-pins-in-flight-per-tenant" in busy.error
    assert sched.pin(order(4, "beta", 4)) is None  # another tenant's bound
    replies = run_pins(sched, worker)
    assert all(replies[i].pin is not None for i in (1, 2, 4)), replies
    assert not computed(worker, document(3, 48))
    # alpha holds 24 of its 32 pages: 12 more do not fit, though the server's budget has room
    share = sched.pin(order(5, "alpha", 5))
    assert share is not None and share.refusal == "refused", share
    assert "--max-pinned-share-per-tenant" in share.error
    assert sched.pin(order(6, "beta", 6)) is None
    replies = run_pins(sched, worker)
    assert replies[6].pin is not None and not computed(worker, document(5, 48))
    # the refused and answered orders are no longer in flight: alpha may pin what fits
    assert sched.pin(PinPrefix(7, document(7, 16), cache_salt="alpha", tenant="alpha")) is None
    assert run_pins(sched, worker)[7].pin is not None
    assert sched.pins.pinned_tokens("memory") == (12 * 4 + 4) * 4
