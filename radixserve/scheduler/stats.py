"""The scheduler's counters and the `SchedulerStats` it answers `GetStats` with (/metrics,
/server_info): what the step loop counts, joined with the pool's, the pins', the grammar
compiler's and the disk tier's own figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.protocol import SchedulerStats

if TYPE_CHECKING:
    from radixserve.scheduler.core import Scheduler
    from radixserve.scheduler.disk_tier import DiskTier
    from radixserve.scheduler.grammar import GrammarCompiler


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # from memory and from disk
    cached_prompt_tokens_disk: int = 0  # of those, loaded from the disk tier
    generation_tokens: int = 0
    retractions: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    segment_reused_tokens: int = 0  # prompt tokens copied from the segment cache (in cached_prompt_tokens)
    segment_recomputed_tokens: int = 0  # of those, recomputed in context


def scheduler_stats(sched: Scheduler, req_id: int) -> SchedulerStats:
    kv, counters = sched.kv, sched.counters
    cache = kv.cache.stats()
    return SchedulerStats(
        req_id=req_id,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        total_pages=kv.total_pages,
        free_pages=kv.allocator.num_free,
        cached_pages=cache.cached_pages,
        evictable_pages=cache.evictable_pages,
        running_pages=kv.running_pages(),
        prompt_tokens_total=counters.prompt_tokens,
        cached_prompt_tokens_total=counters.cached_prompt_tokens,
        generation_tokens_total=counters.generation_tokens,
        num_retractions_total=counters.retractions,
        last_step_time=sched.last_step_time,
        spec_draft_tokens_total=counters.spec_draft_tokens,
        spec_accepted_tokens_total=counters.spec_accepted_tokens,
        cached_prompt_tokens_disk_total=counters.cached_prompt_tokens_disk,
        pinned_tokens_memory=sched.pins.pinned_tokens("memory"),
        pinned_tokens_disk=sched.pins.pinned_tokens("disk"),
        segment_reused_tokens_total=counters.segment_reused_tokens,
        segment_recomputed_tokens_total=counters.segment_recomputed_tokens,
        worker_threads=sched.worker_threads,
        **_grammar_stats(sched.grammars),
        **_disk_stats(kv.disk),
    )


def _disk_stats(disk: DiskTier | None) -> dict[str, Any]:
    if disk is None:
        return {}
    r = disk.report
    return {
        "kv_disk_pages": len(disk.index), "kv_disk_bytes": disk.bytes_used,
        "kv_disk_capacity_bytes": disk.index.capacity * disk.page_bytes,
        "kv_disk_stored_bytes_total": r.stored_bytes, "kv_disk_loaded_bytes_total": r.loaded_bytes,
        "kv_disk_store_seconds_total": r.store_seconds, "kv_disk_load_seconds_total": r.load_seconds,
        "kv_disk_corrupt_pages_total": r.corrupt_pages,
    }


def _grammar_stats(grammars: GrammarCompiler | None) -> dict[str, Any]:
    if grammars is None:
        return {}
    c = grammars.counters
    return {
        "grammar_compiles_total": c.compiles, "grammar_cache_hits_total": c.cache_hits,
        "grammar_compile_buckets": list(c.buckets), "grammar_compile_seconds_sum": c.seconds_sum,
    }
