"""The scheduler's side of segments (scheduler/segments.py), driven by the fake worker of
test_scheduler: fills, what a blend reuses and recomputes, chunks that never split a
recompute group, what reaches the prefix cache, and page accounting through aborts and
retraction mid-blend."""

from __future__ import annotations

import math

from radixserve.protocol import Chunk, SamplingParams, TokenizedRequest
from radixserve.scheduler.segments import MAX_GROUP_TOKENS, segment_namespace
from tests.unit.test_scheduler import FakeWorker, make, rid, run, take_outputs

INSTRUCTION = list(range(10, 42))  # 32 tokens


def doc(seed: int, n: int = 40) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


def rag(name: str, docs: list[list[int]], question: list[int], ratio: float = 0.15, **kw) -> TokenizedRequest:
    """INSTRUCTION + docs (each a segment) + question, as the front sends it."""
    ids, spans = list(INSTRUCTION), []
    for d in docs:
        spans.append((len(ids), len(ids) + len(d)))
        ids += d
    ids += question
    sampling = SamplingParams(temperature=0.0, max_new_tokens=kw.pop("max_new", 4))
    return TokenizedRequest(rid(name), ids, sampling, segments=spans, segment_recompute_ratio=ratio, **kw)


def reuse_chunks(worker: FakeWorker) -> list[Chunk]:
    return [c for batch in worker.steps for c in batch.chunks if c.reuse]


def test_first_sight_fills_each_segment_alone_then_blends_at_its_own_positions():
    sched, worker = make(page_size=4)
    a, b = doc(1), doc(2)
    assert sched.add_request(rag("r1", [a, b], [7, 8, 9])) is None
    run(sched, worker)
    # each document was computed alone, at positions 0.., in the segment namespace
    alone = [c for batch in worker.steps for c in batch.chunks if c.prefix_len == 0 and c.token_ids[:5] in (a[:5], b[:5])]
    assert len(alone) == 2
    ns = segment_namespace(None)
    assert sched.kv.cache.peek_prefix_length(a, ns) == 40 and sched.kv.cache.peek_prefix_length(b, ns) == 40
    runs = [r for c in reuse_chunks(worker) for r in c.reuse]
    assert [(r.position, r.length, r.source_position) for r in runs] == [(32, 40, 0), (72, 40, 0)]
    assert all(r.recompute == math.ceil(0.15 * 40) for r in runs)


def test_documents_in_another_order_are_reused_and_counted():
    sched, worker = make(page_size=4)
    a, b, c = doc(1), doc(2), doc(3)
    sched.add_request(rag("first", [a, b, c], [7, 8]))
    run(sched, worker)
    before = len(worker.steps)
    sched.add_request(rag("second", [c, a], [5, 6]))
    done = run(sched, worker)
    new_chunks = [ch for batch in worker.steps[before:] for ch in batch.chunks]
    assert all(ch.prefix_len >= 32 for ch in new_chunks)  # no fill, the instruction from the cache
    runs = [r for ch in new_chunks for r in ch.reuse]
    assert [(r.position, r.source_position, r.length) for r in runs] == [(32, 0, 40), (72, 0, 40)]
    out = done[("second", 0)]
    assert out["cached"] == 32 + 80
    stats = sched.stats(0)
    assert stats.segment_reused_tokens_total == 120 + 80
    assert stats.segment_recomputed_tokens_total == 5 * math.ceil(0.15 * 40)


def test_segment_fields_reach_the_outputs():
    sched, worker = make(page_size=4)
    sched.add_request(rag("warm", [doc(1)], [3]))
    run(sched, worker)
    sched.add_request(rag("r", [doc(1)], [3], ratio=0.5))
    outputs = []
    for _ in range(100):
        batch = sched.build_batch()
        if batch is None:
            break
        sched.process_result(worker.step(batch))
        outputs += [o for o in take_outputs(sched) if o.rid == rid("r")]
    assert outputs and all(o.segment_tokens == 40 and o.recomputed_tokens == 20 for o in outputs)
    assert all(o.cached_tokens == 32 + 40 for o in outputs)


def test_blended_kv_never_reaches_the_prefix_cache():
    sched, worker = make(page_size=4)
    a, b = doc(1), doc(2)
    sched.add_request(rag("r", [a, b], [7, 8, 9], max_new=6))
    run(sched, worker)
    # the exact prefix (the instruction) is published; nothing from the first reused token on
    assert sched.kv.cache.peek_prefix_length(INSTRUCTION + a + b + [7, 8, 9], None) == 32


def test_a_chunk_never_splits_a_recompute_group():
    sched, worker = make(page_size=1, pages=1024, chunk_size=100)  # groups of 25 tokens
    docs = [doc(i, 60) for i in range(3)]
    sched.add_request(rag("r", docs, [7, 8], ratio=0.2))
    run(sched, worker)
    chunks = [c for batch in worker.steps for c in batch.chunks if c.prefix_len >= 32 and c.token_ids[:1] != [docs[0][0]] or c.reuse]
    runs = [r for c in reuse_chunks(worker) for r in c.reuse]
    assert runs and max(r.length for r in runs) == 25 and all(r.recompute == math.ceil(0.2 * r.length) for r in runs)
    for c in reuse_chunks(worker):
        for r in c.reuse:
            assert c.prefix_len <= r.position and r.position + r.length <= c.prefix_len + len(c.token_ids)
    # groups sit on boundaries counted from each segment's start
    assert {(r.position - 32) % 60 % 25 for r in runs} == {0}
    assert chunks


def test_groups_are_the_same_however_the_budget_falls():
    layouts = []
    for chunk_size in (40, 64, 100):
        sched, worker = make(page_size=1, pages=1024, chunk_size=chunk_size)
        sched.add_request(rag("r", [doc(1, 30), doc(2, 30)], [4]))
        run(sched, worker)
        layouts.append([(r.position, r.length, r.recompute) for c in reuse_chunks(worker) for r in c.reuse])
    # a group is at most a quarter of the budget: 10, 16 and 25 tokens
    assert [max(length for _, length, _ in lay) for lay in layouts] == [10, 16, 25]
    assert MAX_GROUP_TOKENS >= 25


def test_segments_are_a_plain_prompt_when_disabled():
    outs = []
    for options in ({"disable_segment_cache": True}, {"disable_radix_cache": True}):
        sched, worker = make(page_size=4, **options)
        sched.add_request(rag("r", [doc(1), doc(2)], [7, 8]))
        done = run(sched, worker)
        assert not reuse_chunks(worker)
        assert all(c.prefix_len != 0 or c.token_ids[0] == INSTRUCTION[0] for b in worker.steps for c in b.chunks)
        outs.append(done[("r", 0)]["tokens"])
    assert outs[0] == outs[1]


def test_tenants_do_not_share_segments():
    sched, worker = make(page_size=4)
    sched.add_request(rag("a", [doc(1)], [3], cache_salt="tenant-a"))
    run(sched, worker)
    before = len(worker.steps)
    sched.add_request(rag("b", [doc(1)], [3], cache_salt="tenant-b"))
    run(sched, worker)
    fills = [c for batch in worker.steps[before:] for c in batch.chunks if c.prefix_len == 0 and c.token_ids[:3] == doc(1)[:3]]
    assert len(fills) == 1  # computed again for tenant b


def test_requests_waiting_for_the_same_segment_share_one_fill():
    sched, worker = make(page_size=4)
    for i in range(3):
        sched.add_request(rag(f"r{i}", [doc(1)], [3 + i]))
    run(sched, worker)
    fills = [c for batch in worker.steps for c in batch.chunks if c.prefix_len == 0 and c.token_ids[:3] == doc(1)[:3]]
    assert len(fills) == 1


def test_abort_and_retraction_mid_blend_balance_the_pages():
    sched, worker = make(page_size=4, pages=256, chunk_size=32)  # groups of 8 tokens
    docs = [doc(i, 48) for i in range(3)]
    sched.add_request(rag("warm", docs, [3], max_new=1))
    undisturbed = run(sched, worker)
    for i in range(3):
        sched.add_request(rag(f"r{i}", docs[i:] + docs[:i], [3, i], max_new=8))
    retracted = aborted = None
    while (batch := sched.build_batch()) is not None:
        sched.process_result(worker.step(batch))  # debug_checks: the accounting is checked every step
        take_outputs(sched)
        mid = [r for r in sched.running if r.blend is not None and r.blend.start < r.computed_len < r.blend.end]
        if mid and retracted is None:
            retracted = mid[0]
            sched._retract(retracted)  # as when decodes run out of pages
            assert retracted.blend is None and not retracted.pages
        elif mid and aborted is None and mid[0] is not retracted:
            aborted = mid[0]
            sched.abort(aborted.rid)
    assert retracted is not None and aborted is not None
    assert retracted.finished and retracted.finish.type == "length" and len(retracted.output_ids) == 8
    assert aborted.finish.type == "abort"
    # nothing is left locked or owned: every page is free or cached (and evictable)
    stats = sched.kv.cache.stats()
    assert sched.kv.allocator.num_free + stats.cached_pages == sched.kv.total_pages
    assert stats.evictable_pages == stats.cached_pages
    assert undisturbed


def test_a_resumed_request_blends_again():
    from radixserve.protocol import ResumedSample

    sched, worker = make(page_size=4)
    msg = rag("r", [doc(1), doc(2)], [3], max_new=6)
    sched.add_request(msg)
    first = run(sched, worker)[("r", 0)]["tokens"]
    fresh, worker2 = make(page_size=4)
    resumed = TokenizedRequest(
        msg.rid, msg.input_ids, msg.sampling, segments=msg.segments, segment_recompute_ratio=msg.segment_recompute_ratio,
        resume=[ResumedSample(0, [[t] for t in first[:3]])],
    )
    fresh.add_request(resumed)
    rest = run(fresh, worker2)[("r", 0)]["tokens"]
    assert first[:3] + rest == first
    assert reuse_chunks(worker2)  # re-blended on the fresh engine


def test_a_blend_too_large_to_hold_with_its_segments_computes_the_rest_itself():
    # 256 one-token pages: the prompt's own 214 pages and its segments' 180 cannot all be held
    sched, worker = make(page_size=1, pages=256, chunk_size=100)
    docs = [doc(i, 60) for i in range(3)]
    sched.add_request(rag("r", docs, [7, 8], ratio=0.2))
    done = run(sched, worker)
    assert len(done[("r", 0)]["tokens"]) == 4
    reused = [r for c in reuse_chunks(worker) for r in c.reuse]
    assert reused and sum(r.length for r in reused) < 180


def test_a_pinned_segment_is_computed_alone_and_reused_without_a_fill():
    from radixserve.protocol import PinPrefix, UnpinPrefix

    sched, worker = make(page_size=4)
    a = doc(1)
    assert sched.pin(PinPrefix(1, a, cache_salt="t", segment=True)) is None
    run(sched, worker)
    pins = sched.list_pins(0).pins
    assert len(pins) == 1 and pins[0].segment and pins[0].cache_salt == "t" and pins[0].tokens == 40
    before = len(worker.steps)
    sched.add_request(rag("r", [a], [3], cache_salt="t"))
    run(sched, worker)
    chunks = [c for b in worker.steps[before:] for c in b.chunks]
    assert not [c for c in chunks if c.token_ids[:3] == a[:3]]  # no fill: the pinned segment was there
    assert [r.length for c in chunks for r in c.reuse] == [40]
    assert sched.unpin(UnpinPrefix(2, input_ids=a, cache_salt="t", segment=True)).pins[0].pin_id == pins[0].pin_id


def test_copies_cost_less_of_the_step_budget():
    from radixserve.config import ServerConfig
    from radixserve.protocol import WorkerInfo, WorkerReady
    from radixserve.scheduler.core import Scheduler

    config = ServerConfig(page_size=1, chunk_size=64, debug_checks=True)  # groups of 16
    info = WorkerInfo(2048, 1, 2048, 1000, [2], "fake", "float32", "cpu", "avx2", blend_copy_cost=0.25)
    sched, worker = Scheduler(config, WorkerReady(info), lambda r: None), FakeWorker(64, 2048, 1)
    docs = [doc(i, 64) for i in range(3)]
    sched.add_request(rag("warm", docs, [3], max_new=1))
    run(sched, worker)
    before = len(worker.steps)
    sched.add_request(rag("r", docs[::-1], [3], ratio=0.25, max_new=1))
    run(sched, worker)
    chunks = [c for b in worker.steps[before:] for c in b.chunks if c.reuse]
    # a group of 16 costs 4 recomputed + 12 copies x 0.25 = 7 of the 64-token budget
    assert max(len(c.token_ids) for c in chunks) > 64
    for c in chunks:
        copied = sum(r.length - r.recompute for r in c.reuse)
        assert len(c.token_ids) - copied * 0.75 <= 64


def test_the_fills_of_the_request_nearest_to_ready_go_first():
    """Shortest job first among fills: the later request needing one fill is served before the
    earlier one needing three, instead of after all of them."""
    sched, worker = make(page_size=4, chunk_size=40)
    a, b, c, d = doc(1), doc(2), doc(3), doc(4)
    sched.add_request(rag("far", [a, b, c], [7, 8]))
    sched.add_request(rag("near", [d], [5, 6]))
    first_token_step: dict[str, int] = {}
    names = {rid("far"): "far", rid("near"): "near"}
    for step in range(200):
        batch = sched.build_batch()
        if batch is None:
            break
        sched.process_result(worker.step(batch))
        for out in take_outputs(sched):
            if out.new_token_ids:
                first_token_step.setdefault(names[out.rid], step)
    starts = (a[:5], b[:5], c[:5], d[:5])
    fills = [ch.token_ids[:5] for batch in worker.steps for ch in batch.chunks
             if ch.prefix_len == 0 and ch.token_ids[:5] in starts]
    assert fills[0] == d[:5]
    assert first_token_step["near"] < first_token_step["far"]
