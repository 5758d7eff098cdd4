"""The scheduler's decisions, free of sockets: admit, batch, retract, stop, report.

One step, as `Scheduler.build_batch` makes it:

    1. end aborted requests (their computed prefix goes to the cache, the rest is freed);
    2. give every decoding request a page for its next token, retracting the requests that
       lose least when pages run out;
    3. continue chunked prefills of running requests, within the step's prompt-token budget;
    4. admit waiting requests in policy order while the budget, rows and pages allow.

Steps 3 and 4 share the budget (`_schedule_prompts`): while a long prefill runs, short
prefills and admission get a share of every step first, so nothing waits behind a long prompt.
After an engine restart, a suspect of the crash (`Request.isolated`) takes steps 2-4 alone
until it samples a token (`_schedule_isolated`): a second crash then names it and no other.

`process_result` then appends sampled tokens, checks stop conditions and produces the outputs
the front streams to clients.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from radixserve.cache.allocator import OutOfPages
from radixserve.config import ServerConfig
from radixserve.protocol import (
    Chunk,
    ChunkResult,
    DiskOps,
    FinishReason,
    FlushCacheDone,
    ForwardBatch,
    ForwardResult,
    NewRequest,
    PinDone,
    PinList,
    PinPrefix,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    SchedulerStats,
    TokenBatchOut,
    TokenizedRequest,
    UnpinPrefix,
    WorkerReady,
)
from radixserve.scheduler.draft_pace import DraftPace
from radixserve.scheduler.grammar import GrammarBusy, GrammarCompiler, GrammarError
from radixserve.scheduler.kv import KVManager, pages_for
from radixserve.scheduler.ngram import NgramDrafter
from radixserve.scheduler.pins import PinRefused, Pins
from radixserve.scheduler.policy import order_waiting, shares_uncached_prefix
from radixserve.scheduler.request import PromptLogprobs, Request, Speculation
from radixserve.scheduler.segments import group_tokens, missing_spans, segment_namespace
from radixserve.scheduler.stats import Counters, scheduler_stats
from radixserve.scheduler.step_cost import StepCost
from radixserve.scheduler.stop import StopChecker

log = logging.getLogger("radixserve.scheduler")

INITIAL_NEW_TOKEN_RATIO = 0.5  # share of max_new_tokens admission expects a request to use
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per step without retraction
RETRACT_RATIO_STEP = 0.2  # added after each retraction: admission learns to leave more room
DEDUP_MIN_TOKENS = 32  # shared uncached prefix worth waiting one prefill for
ADMISSION_SHARE = 4  # 1/4 of a step's prompt budget goes to short prompts while a long one runs
FILL_RID_BASE = -(1 << 48)  # segment fills' rids count down from here: never a front's (>= 0) or a pin's


class Scheduler:
    def __init__(
        self,
        config: ServerConfig,
        ready: WorkerReady,
        stop_checker_factory: Callable[[Request], StopChecker | None],
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        info = ready.info
        self.page_size = info.page_size
        self.context_len = info.context_len
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.kv = KVManager(
            info.total_pages, info.page_size, config.max_running_requests,
            enable_cache=not config.disable_radix_cache,
        )
        if config.kv_disk_dir and ready.disk_page_bytes:
            self.kv.attach_disk(
                ready.kv_model_key, int(config.kv_disk_gb * 2**30) // ready.disk_page_bytes,
                ready.disk_pages, ready.disk_page_bytes,
            )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.counters = Counters()
        self.new_token_ratio = INITIAL_NEW_TOKEN_RATIO
        self.last_step_time = 0.0
        self.worker_threads = 0  # as the last ForwardResult told it
        self._arrivals = 0
        self._make_stop_checker = stop_checker_factory
        self.grammars = grammars
        self.speculative = config.speculative_algorithm == "ngram"
        self._bitmask: Any = None  # one row, refilled for each constrained chunk that samples
        self._worker_keys: set[str] = set()  # the samples the worker holds sampling state for
        self._aborting: set[int] = set()  # submissions to end at the start of the next step
        # submissions whose sample 0 has not yet sent the prompt's logprobs: their other samples
        # wait, then take the prompt from the cache instead of computing it (and its logprobs) again
        self._prompt_logprobs_pending: set[int] = set()
        self._in_flight: list[tuple[Request, Chunk]] = []  # this step's chunks
        self._in_flight_keys: set[str] = set()
        self._finished_keys: list[str] = []
        # for the front, until `take_messages`
        self._outputs: list[RequestOutput] = []
        self._rejections: list[RequestRejected] = []  # refused after queueing (a bad grammar)
        self._replies: list[PinDone] = []  # pins made in a step
        self.pins = Pins(
            self.kv, config.max_pinned_fraction, config.max_pinned_share_per_tenant, config.max_pins_in_flight_per_tenant,
        )
        if self.kv.caching and not config.disable_segment_cache:
            self.kv.segment_group = group_tokens(config.chunk_size, ADMISSION_SHARE)
        self._copy_cost = info.blend_copy_cost  # of a blend's copied tokens, in the step budget
        self._step_cost = StepCost(config.chunk_size, info.context_token_cost)
        # segments being computed alone for the segment cache, by (namespace, tokens): every
        # request waiting for the same segment waits for the same fill
        self._fills: dict[tuple[str, tuple[int, ...]], Request] = {}
        self._fill_rids = itertools.count(FILL_RID_BASE, -1)

    # ------------------------------------------------------------------ requests in

    def add_request(self, msg: TokenizedRequest) -> RequestRejected | None:
        """Queue a submission's samples: all n of a new request, or the unfinished ones of a
        request resumed after an engine restart (`msg.resume`), each from its tokens so far."""
        n = msg.sampling.n
        resumed = {s.index: s for s in msg.resume}
        indices = sorted(resumed) if resumed else list(range(n))
        # a resumed request was queued by the engine before: a full queue must not lose it now
        if not resumed and len(self.waiting) + n > self.config.max_queued_requests:
            return RequestRejected(msg.rid, "the waiting queue is full; retry later", retryable=True)
        if pages_for(len(msg.input_ids) + 1, self.page_size) > self.kv.total_pages:
            return RequestRejected(
                msg.rid,
                f"the prompt ({len(msg.input_ids)} tokens) does not fit in the KV pool "
                f"({self.kv.total_pages * self.page_size} tokens)",
            )
        pending = None
        if msg.sampling.grammar is not None:
            if self.grammars is None:
                return RequestRejected(msg.rid, "constrained decoding is not available in this server")
            try:  # never blocks; admission waits for the compile
                pending = self.grammars.compile(msg.sampling.grammar, resumed=bool(resumed))
            except GrammarBusy as exc:
                return RequestRejected(msg.rid, str(exc), retryable=True)
        prompt_logprobs = msg.return_logprob and 0 <= msg.logprob_start_len < len(msg.input_ids)
        if prompt_logprobs and len(indices) > 1 and indices[0] == 0:
            self._prompt_logprobs_pending.add(msg.rid)
        spans = self._reusable_spans(msg)
        fills = self._fill(spans, msg.input_ids, msg.cache_salt or None)
        for i in indices:
            sampling = msg.sampling
            if n > 1:
                seed = None if sampling.seed is None else sampling.seed + i
                sampling = msgspec.structs.replace(sampling, n=1, seed=seed)
            groups = resumed[i].output_groups if resumed else []
            output_ids = [t for group in groups for t in group]
            req = Request(
                rid=msg.rid, index=i, input_ids=msg.input_ids, sampling=sampling,
                namespace=msg.cache_salt or None, arrival=self._arrivals,
                return_logprob=msg.return_logprob,
                # the prompt's logprobs are computed once, by sample 0, and shared by the front
                logprob_start_len=msg.logprob_start_len if i == 0 else -1,
                top_logprobs_num=msg.top_logprobs_num, grammar_wait=pending,
                output_ids=output_ids, isolated=msg.isolate,
                # reported before the restart: the client keeps those figures
                admitted=bool(output_ids), cached_tokens=resumed[i].cached_tokens if output_ids else 0,
                segment_tokens=resumed[i].segment_tokens if output_ids else 0,
                recomputed_tokens=resumed[i].recomputed_tokens if output_ids else 0,
                segments=spans, recompute_ratio=msg.segment_recompute_ratio, fills=fills,
            )
            self._arrivals += 1
            req.stop_checker = self._make_stop_checker(req)
            if req.stop_checker is not None:
                req.stop_checker.replay(groups)
            self.waiting.append(req)
        return None

    def _reusable_spans(self, msg: TokenizedRequest) -> list[tuple[int, int]]:
        """The request's segment spans that may come from the segment cache: none when segments
        are off (a plain prompt then), and never one at position 0, whose KV standalone is its
        exact KV anyway (the prefix cache serves it). The front checked the spans."""
        spans: list[tuple[int, int]] = []
        if not self.kv.segment_group:
            return spans
        for begin, end in msg.segments:
            if 0 < begin < end <= len(msg.input_ids) and (not spans or spans[-1][1] <= begin):
                spans.append((begin, end))
        return spans

    def _fill(self, spans: list[tuple[int, int]], tokens: list[int], namespace: str | None) -> list[Request]:
        """Queue a prompt-only request for each segment the segment cache lacks (shared with any
        fill already queued for it); the request is admitted once they are done."""
        fills: list[Request] = []
        for segment in missing_spans(spans, tokens, self.kv.cache, namespace, self.page_size):
            key = (segment_namespace(namespace), tuple(segment))
            fill = self._fills.get(key)
            if fill is None or fill.finished:
                fill = Request(
                    rid=next(self._fill_rids), index=0, input_ids=segment,
                    sampling=SamplingParams(max_new_tokens=0, temperature=0.0), namespace=key[0],
                    arrival=self._arrivals, segment_fill=True,
                )
                self._arrivals += 1
                self._fills[key] = fill
                self.waiting.append(fill)
            fills.append(fill)
        return fills

    def abort(self, rid: int) -> None:
        """End every sample of the submission `rid`; an id that is no longer live is ignored."""
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            if req.grammar_wait is not None and self.grammars is not None:
                self.grammars.give_up(req.grammar_wait)
            self._finish(req, FinishReason("abort", message="aborted"))
        if any(r.rid == rid for r in self.running):
            self._aborting.add(rid)  # ended at the start of the next step (`build_batch`)

    def pin(self, order: PinPrefix) -> PinDone | None:
        """Queue a prefix to pin as a prompt-only request (scheduler/pins.py); answered when it
        ends (`_finish`), or now, before anything is computed, if it is refused: a full waiting
        queue (a pin is a prefill, counted like any request), or the pins' budgets and bounds."""
        if len(self.waiting) >= self.config.max_queued_requests:
            return PinDone(order.req_id, error="the waiting queue is full; retry later", refusal="queue_full")
        if order.segment:
            if not self.kv.segment_group:
                return PinDone(order.req_id, error="the segment cache is off (--disable-segment-cache or no prefix cache)")
            order = msgspec.structs.replace(order, cache_salt=segment_namespace(order.cache_salt))
        if pages_for(len(order.input_ids) + 1, self.page_size) > self.kv.total_pages:
            return PinDone(order.req_id, error=f"the prefix ({len(order.input_ids)} tokens) does not fit in the KV pool")
        try:
            self.pins.take_order(order)
        except PinRefused as exc:
            return PinDone(order.req_id, error=str(exc), refusal=exc.refusal)
        self.waiting.append(Request(
            rid=-1 - order.req_id, index=0, input_ids=order.input_ids,  # never a front's rid (>= 0)
            sampling=SamplingParams(max_new_tokens=0, temperature=0.0), namespace=order.cache_salt or None,
            arrival=self._arrivals, pin=order,
        ))
        self._arrivals += 1
        return None

    def unpin(self, order: UnpinPrefix) -> PinList:
        namespace = segment_namespace(order.cache_salt) if order.segment else order.cache_salt
        released = self.pins.release(order.pin_ids, order.input_ids, namespace)
        return PinList(order.req_id, [pin.info() for pin in released])

    def list_pins(self, req_id: int) -> PinList:
        return PinList(req_id, self.pins.list())

    def flush_cache(self, req_id: int) -> FlushCacheDone:
        freed = self.kv.flush()
        return FlushCacheDone(req_id, freed, ok=not self.running)

    def stats(self, req_id: int) -> SchedulerStats:
        return scheduler_stats(self, req_id)

    def take_messages(self) -> list[RequestRejected | PinDone | TokenBatchOut]:
        """What the scheduler has for the front since the last call, in the order to send it:
        refusals of queued requests, pins made, then every sample's outputs in one batch."""
        messages: list[RequestRejected | PinDone | TokenBatchOut] = [*self._rejections, *self._replies]
        if self._outputs:
            messages.append(TokenBatchOut(self._outputs))
        self._rejections, self._replies, self._outputs = [], [], []
        return messages

    def in_flight_rids(self) -> list[int]:
        """The submissions of the step being built or run (an engine failure's suspects)."""
        return sorted({req.rid for req, _ in self._in_flight})

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def only_waiting(self) -> bool:
        """Nothing to step but requests whose grammars compile or whose pages are being read
        from disk: the loop may wait a little (and poll the worker for the reads)."""
        if self.running:
            return False
        reading = self.kv.disk is not None and self.kv.disk.waiting_on_reads
        return all(r.waits_for_grammar or reading for r in self.waiting)

    def _resolve_grammars(self) -> None:
        """Give waiting samples whose grammar has compiled their matchers; refuse the requests
        whose grammar failed or timed out (a 400 for the client, nothing more)."""
        for req in [r for r in self.waiting if r.waits_for_grammar]:
            if req.finished:
                continue  # refused with an earlier sample of its submission
            try:
                compiled = req.grammar_wait.compiled()
            except GrammarError as exc:
                self._refuse(req.rid, str(exc))
                continue
            if compiled is not None:
                req.grammar_compiled(self.grammars.matcher(compiled))
                # a resumed sample: its matcher takes the tokens the last engine's accepted
                if not all(req.matcher.accept_token(t) for t in req.output_ids):
                    self._refuse(req.rid, "the request's output so far no longer fits its grammar")

    def _refuse(self, rid: int, message: str) -> None:
        """Drop every sample of a queued submission and tell the front why (no output: none
        of its samples was admitted, since all wait for the same grammar)."""
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            if req.grammar_wait is not None:
                self.grammars.give_up(req.grammar_wait)
            req.end(FinishReason("abort", message=message))
        self._prompt_logprobs_pending.discard(rid)
        self._rejections.append(RequestRejected(rid, message))

    # ------------------------------------------------------------------ one step

    def build_batch(self) -> ForwardBatch | None:
        for req in [r for r in self.running if r.rid in self._aborting]:
            self._finish(req, FinishReason("abort", message="aborted"))
        self._aborting.clear()
        self._in_flight, self._in_flight_keys = [], set()
        self.pins.expire(time.time())
        if self.grammars is not None:
            self._resolve_grammars()
        if self.kv.disk is not None:
            self.kv.disk.plan(self.waiting)
        if not self._schedule_isolated():
            self._schedule_step()
        if not self._in_flight:
            return None
        assigned, appended, released = self.kv.take_deltas()
        new_requests = []
        for req, _ in self._in_flight:
            if req.key not in self._worker_keys:
                self._worker_keys.add(req.key)
                prompt = req.input_ids if req.sampling.repetition_penalty != 1.0 else []
                # the worker applies a grammar's bitmask, never the grammar: it stays here
                sampling = req.sampling if req.sampling.grammar is None else msgspec.structs.replace(req.sampling, grammar=None)
                new_requests.append(NewRequest(
                    req.key, sampling, req.top_logprobs_num, prompt, req.return_logprob,
                    output_ids=list(req.output_ids),  # non-empty only for a sample resumed after a restart
                ))
        finished, self._finished_keys = self._finished_keys, []
        return ForwardBatch(
            chunks=[c for _, c in self._in_flight], new_requests=new_requests,
            assigned=assigned, appended=appended, released=released, finished=finished,
            disk=self._disk_ops(),
        )

    def _disk_ops(self) -> DiskOps | None:
        return None if self.kv.disk is None else self.kv.disk.take_ops()

    def _schedule_step(self) -> None:
        self._schedule_decodes()
        if self.waiting:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self._schedule_prompts(self.config.chunk_size)
        if not self._in_flight and self._unlock_stuck_blends():
            self._continue_prefills(self._unscheduled_prefills(), self.config.chunk_size)
        if not self._in_flight and len(self.running) > 1:
            # every running request is a prefill stuck for pages held by the others: make room
            self._retract(self._victim())
            self._schedule_decodes()
            self._continue_prefills(self._unscheduled_prefills(), self.config.chunk_size)

    def _unlock_stuck_blends(self) -> bool:
        """Nothing could run, and blends hold segment pages they have not copied yet: they
        compute their remaining reused tokens instead, and the pages become evictable. True
        if any did (admission leaves room for a blend's segment pages, so this is rare)."""
        stuck = [r for r in self.running if r.blend is not None and r.blend.nodes]
        for req in stuck:
            self.kv.release_segments(req)
            req.blend.drop_after(req.computed_len)
            if not req.blend.runs:
                req.blend = None
        return bool(stuck)

    def _schedule_isolated(self) -> bool:
        """A suspect of the last engine crash runs alone, one step at a time, until it samples
        a token: if it crashes the engine again, the failing step names it and nothing else.
        False when there is none, or it cannot go now (no pages or row yet): a normal step runs,
        without it, and frees what it needs."""
        req = next((r for r in self.running if r.isolated), None)
        if req is None:
            # the first that can go (sample 1 of a request may wait for sample 0's prefill)
            for candidate in [r for r in self.waiting if r.isolated and not r.waits_for_grammar]:
                self._admit(self.config.chunk_size, [candidate])
                if self._in_flight:
                    return True
            return False
        if req.is_prefilling:
            self._continue_prefills([req], self.config.chunk_size)
        else:
            try:
                self.kv.grow(req, req.computed_len + 1)
            except OutOfPages:
                return False
            self._add_chunk(req, 1)
        return bool(self._in_flight)

    def pending_worker_cleanup(self) -> ForwardBatch | None:
        """Rows released, states finished or disk work queued while no forward runs: tell the
        worker anyway; and while pages are read from disk, ask it how far it got (a poll)."""
        disk = self._disk_ops()
        polling = self.kv.disk is not None and self.kv.disk.waiting_on_reads
        if not (self._finished_keys or self.kv.released or self.kv.assigned or self.kv.appended or disk or polling):
            return None
        assigned, appended, released = self.kv.take_deltas()
        finished, self._finished_keys = self._finished_keys, []
        return ForwardBatch(chunks=[], assigned=assigned, appended=appended, released=released, finished=finished,
                            disk=disk)

    def write_back_cache(self) -> ForwardBatch | None:
        """At a stop, with a disk tier: every unlocked cached page goes to disk (eviction writes
        back what the disk lacks), so the next start finds it. The batch to send, if any."""
        if self.kv.disk is None:
            return None
        self.kv.cache.evict(self.kv.cache.evictable_pages)
        return self.pending_worker_cleanup()

    def absorb_worker_report(self, result: ForwardResult) -> None:
        """What any step brings back besides its chunks' results: the disk threads' progress,
        the worker's thread count."""
        if result.threads:
            self.worker_threads = result.threads
        if result.disk is not None and self.kv.disk is not None:
            self.kv.disk.absorb(result.disk)

    def _schedule_decodes(self) -> None:
        decoding = [r for r in self.running if not r.is_prefilling and not r.isolated and not self._scheduled(r)]
        while True:
            need = sum(max(0, pages_for(r.computed_len + 1, self.page_size) - len(r.pages)) for r in decoding)
            if need <= self.kv.available_pages or len(self.running) <= 1:
                break
            victim = self._victim()
            self._retract(victim)
            if victim in decoding:
                decoding.remove(victim)
        drafting = self._drafting(decoding)
        for req in decoding:
            draft = self._draft(req) if drafting else []
            try:
                self.kv.grow(req, req.computed_len + 1 + len(draft))
            except OutOfPages:
                draft = []  # no room for the draft's slots: a plain decode step
                try:
                    self.kv.grow(req, req.computed_len + 1)
                except OutOfPages:
                    continue  # a lone request at the pool's limit: context_len prevents this
            self._add_chunk(req, 1, draft)

    def _drafting(self, decoding: list[Request]) -> bool:
        """Speculate only while a step is bound by memory reads (few sequences decoding, no
        prompt to prefill): verifying drafts in a compute-bound step would only slow it."""
        if not self.speculative or len(decoding) > self.config.speculative_max_batch_size:
            return False
        return not self.waiting and not any(r.is_prefilling for r in self.running)

    def _draft(self, req: Request) -> list[int]:
        """The request's next draft: tokens its own prompt and output suggest (scheduler/ngram.py),
        at most what its pace allows (scheduler/draft_pace.py: none while its drafts keep
        failing) and never past its budget (the token sampled after the draft counts too). Empty
        for a constrained request: its bitmask holds for one position."""
        if req.matcher is not None:
            return []
        if req.spec is None:
            c = self.config
            req.spec = Speculation(
                NgramDrafter(c.speculative_ngram_min_match_window_size, c.speculative_ngram_max_match_window_size),
                DraftPace(c.speculative_num_draft_tokens),
            )
        room = min(req.sampling.max_new_tokens - len(req.output_ids), self.context_len - req.fill_len) - 1
        return req.spec.drafter.propose(req.input_ids, req.output_ids, min(req.spec.pace.allow(), room))

    def _schedule_prompts(self, budget: int) -> None:
        """Share the step's prompt-token budget between running prefills and admission.

        A long prefill (more left than one step's budget) would otherwise take every step's
        budget until it is done, and a short request behind it would wait for all of it. While
        a long prefill runs, the short prefills and admission get a share of each step first,
        and the long ones the rest; whatever one side leaves goes to the other, so neither
        starves and no budget is wasted.
        """
        prefilling = self._unscheduled_prefills()
        long = [r for r in prefilling if r.fill_len - r.computed_len > budget]
        short = [r for r in prefilling if r not in long]
        if not long:
            self._admit(self._continue_prefills(short, budget))
            return
        share = max(1, budget // ADMISSION_SHARE)
        unused = self._admit(self._continue_prefills(short, share))
        self._admit(self._continue_prefills(long, budget - share + unused))

    def _unscheduled_prefills(self) -> list[Request]:
        return [r for r in self.running if r.is_prefilling and not r.isolated and not self._scheduled(r)]

    def _continue_prefills(self, requests: list[Request], budget: int) -> int:
        """Next prefill chunks of `requests`, in order, within `budget`; returns what is left."""
        for req in requests:
            if budget <= 0:
                break
            n, cost = self._next_chunk(req, budget)
            if n > 0:
                self._add_chunk(req, n)
                budget -= cost
        return budget

    def _next_chunk(self, req: Request, budget: int) -> tuple[int, int]:
        """Pages for the request's next chunk within `budget`, and its (length, cost): tokens deep
        in a long context cost more, for their attention (`StepCost`), a blend's copied tokens
        less than computed ones (`BlendPlan.cost`), and a blend's chunk splits no recompute group."""
        start, step = req.computed_len, self._step_cost
        if req.blend is None:
            n = self._grow_for_chunk(req, step.prefill_len(start, req.fill_len - start, budget))
            return n, step.cost(start, n)
        blend = req.blend
        end = step.blend_end(start, budget, lambda b: blend.reach(start, req.fill_len, b, self._copy_cost))
        n = self._chunk_len(req, self._grow_for_chunk(req, end - start))
        return n, step.cost(start, n, blend.cost(start, start + n, self._copy_cost))

    def _admit(self, budget: int, isolated: list[Request] | None = None) -> int:
        """Admit waiting requests with prefill chunks of at most `budget` tokens in all (only
        `isolated`, given it: a crash suspect admitted alone); returns the budget left."""
        if not self.waiting:
            return budget
        candidates = isolated or order_waiting(self.waiting, self.config.schedule_policy, self.kv.cache)
        for req in candidates:
            if budget <= 0 or not self.kv.has_free_row or len(self.running) >= self.config.max_running_requests:
                break
            if req.waits_for_grammar or req.waits_for_fills:
                continue  # its grammar compiles, or its segments; the others need not wait for it
            if req.isolated and isolated is None:
                continue  # it runs alone (_schedule_isolated)
            in_memory = self.kv.cache.peek_prefix_length(req.fill_ids[: req.match_limit], req.namespace)
            on_disk, reading = self.kv.disk_run(req, in_memory)
            if reading:
                continue  # its pages on disk are being read; the others need not wait for it
            cached = in_memory + on_disk * self.page_size
            if self._should_wait_for_prefill(req, cached):
                continue
            # a blend's copies cost less of the budget: its chunk may hold more tokens
            n = min(req.fill_len - cached, budget if not req.segments else int(budget / self._copy_cost))
            # the pages loaded from disk need pool pages too, the matched ones do not; a blend
            # locks the segment pages it copies from until its prompt is computed
            need = pages_for(cached + n, self.page_size) - in_memory // self.page_size
            if req.segments:
                extra = self._segment_pages(req)
                # one that cannot fit with them copies what it can (`_unlock_stuck_blends`)
                if pages_for(req.fill_len, self.page_size) + extra <= self.kv.total_pages:
                    need += extra
            reserve = self._reserved_pages() + self._future_pages(req, cached + n) if self.running else 0
            # the matched pages get locked: they stop counting as evictable
            if self.kv.available_pages - in_memory // self.page_size < need + reserve:
                break  # not `continue`: smaller requests must not starve this one forever
            from_memory, from_disk = self.kv.admit(req)
            matched = from_memory + from_disk
            n, cost = self._next_chunk(req, budget)
            if n == 0:
                self.kv.release(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            if req.admit() and not req.segment_fill:
                self._count_admission(req, matched, from_disk)
            self._add_chunk(req, n)
            budget -= cost
        return budget

    def _segment_pages(self, req: Request) -> int:
        """Pages of the request's segments cached now (a blend would lock them)."""
        ns = segment_namespace(req.namespace)
        cached = (self.kv.cache.peek_prefix_length(req.input_ids[a:b], ns) for a, b in req.segments)
        return sum(cached) // self.page_size

    def _count_admission(self, req: Request, matched: int, from_disk: int) -> None:
        """A client's sample admitted for the first time: what it found cached (segment tokens
        a blend copies count as cached, as the reused share of its prompt)."""
        reused = req.blend.segment_tokens if req.blend is not None else 0
        recomputed = req.blend.recomputed_tokens if req.blend is not None else 0
        req.cached_tokens, req.segment_tokens, req.recomputed_tokens = matched + reused, reused, recomputed
        c = self.counters
        c.prompt_tokens += len(req.input_ids)
        c.cached_prompt_tokens += matched + reused
        c.cached_prompt_tokens_disk += from_disk
        c.segment_reused_tokens += reused
        c.segment_recomputed_tokens += recomputed

    def _chunk_len(self, req: Request, n: int) -> int:
        """The next chunk's length, at most n: a blend's chunk never splits a recompute group,
        and never mixes reused tokens with positions whose prompt logprobs are wanted."""
        if req.blend is None or n <= 0:
            return n
        start = req.computed_len
        end = req.blend.cut(start, start + n)
        if req.wants_input_logprobs and start < req.blend.end < end:
            end = req.blend.end
        return end - start

    def _should_wait_for_prefill(self, req: Request, cached: int) -> bool:
        """Defer a request whose prefix a running prefill is about to publish (lpm, or n > 1
        samples), and samples 1..n-1 until sample 0 has sent the prompt's logprobs (even without
        a cache: the front must have them before any other sample's output)."""
        if req.index > 0 and req.rid in self._prompt_logprobs_pending:
            return True
        if not self.kv.caching:
            return False
        if req.index > 0:
            siblings = [r for r in self.running if r.rid == req.rid and r.is_prefilling]
            return shares_uncached_prefix(req, cached, siblings, self.page_size)
        if self.config.schedule_policy != "lpm":
            return False
        prefilling = [r for r in self.running if r.is_prefilling]
        return shares_uncached_prefix(req, cached, prefilling, max(self.page_size, DEDUP_MIN_TOKENS))

    def _grow_for_chunk(self, req: Request, n: int) -> int:
        """Pages for the next n tokens, or for as many as fit; returns the tokens covered."""
        try:
            self.kv.grow(req, req.computed_len + n)
            return n
        except OutOfPages:
            fit = (len(req.pages) + self.kv.available_pages) * self.page_size - req.computed_len
            n = max(0, min(n, fit))
            if n:
                self.kv.grow(req, req.computed_len + n)
            return n

    def _reserved_pages(self) -> int:
        """Pages running requests are expected to still need (admission leaves room for them)."""
        return sum(self._future_pages(r, r.computed_len) for r in self.running)

    def _future_pages(self, req: Request, computed: int) -> int:
        """Pages the request may still need once `computed` tokens are stored."""
        left_prompt = max(0, len(req.input_ids) - computed)
        left_output = req.sampling.max_new_tokens - len(req.output_ids)
        return pages_for(left_prompt + int(left_output * self.new_token_ratio), self.page_size)

    def _victim(self) -> Request:
        """The running request that loses least: fewest output tokens, then latest arrival."""
        return min(self.running, key=lambda r: (len(r.output_ids), -r.arrival))

    def _retract(self, req: Request) -> None:
        self._in_flight = [(r, c) for r, c in self._in_flight if r is not req]
        self._in_flight_keys.discard(req.key)
        self.kv.release(req)
        req.retract()
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.counters.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_STEP)
        log.info("retracted %s (%d output tokens kept)", req.key, len(req.output_ids))

    def _scheduled(self, req: Request) -> bool:
        return req.key in self._in_flight_keys

    def _add_chunk(self, req: Request, n: int, draft: list[int] | None = None) -> None:
        """The next `n` known tokens of the request (and, for a decode, a draft to verify)."""
        start, end = req.computed_len, req.computed_len + n
        fill = req.fill_ids
        sample = end == req.fill_len and req.sampling.max_new_tokens > len(req.output_ids)
        chunk = Chunk(rid=req.key, row=req.row, prefix_len=start, token_ids=fill[start:end], sample=sample)
        if draft:
            chunk.token_ids += draft
            chunk.draft_len = len(draft)
        if req.blend is not None:
            chunk.reuse = req.blend.runs_in(start, end)
        if sample and req.matcher is not None:
            if self._bitmask is None:
                self._bitmask = self.grammars.new_bitmask()
            req.matcher.fill_next_token_bitmask(self._bitmask)
            chunk.token_bitmask = self._bitmask.numpy().tobytes()
        if req.wants_input_logprobs:
            first = max(req.logprob_start_len, 1) - 1  # logits at position p score token p + 1
            last = min(end, len(req.input_ids) - 1)  # exclusive: position L-1 scores the output
            if max(first, start) < last:
                chunk.input_logprobs_from = max(first, start) - start
                if end < req.fill_len:
                    chunk.next_token_id = fill[end]
        self._in_flight.append((req, chunk))
        self._in_flight_keys.add(req.key)

    # ------------------------------------------------------------------ results

    def process_result(self, result: ForwardResult) -> None:
        self.last_step_time = time.time()
        self.absorb_worker_report(result)
        for (req, chunk), res in zip(self._in_flight, result.results):
            if chunk.draft_len:
                self._take_verified(req, chunk, res)
                continue
            req.add_computed(len(chunk.token_ids))
            self._collect_input_logprobs(req, chunk, res)
            if chunk.sample:
                self._append_token(req, res.next_token_id, res.logprob, res.top_logprobs)
            elif req.computed_len == req.fill_len and req.sampling.max_new_tokens <= len(req.output_ids):
                self._finish(req, FinishReason("length"))  # max_new_tokens 0: prompt logprobs only
            if not req.finished and req.blend is not None and req.computed_len >= req.blend.end:
                self.kv.release_segments(req)  # copied: the segment cache may evict them again
            if not req.finished and req.computed_len < req.fill_len:
                self.kv.cache_progress(req)
        self._in_flight, self._in_flight_keys = [], set()
        if self.config.debug_checks:
            self.kv.check(self.running)

    def _collect_input_logprobs(self, req: Request, chunk: Chunk, res: ChunkResult) -> None:
        if chunk.input_logprobs_from < 0:
            return
        req.input_logprobs.extend(res.input_logprobs)
        req.input_top_logprobs.extend(res.input_top_logprobs)

    def _take_verified(self, req: Request, chunk: Chunk, res: ChunkResult) -> None:
        """A decode step with a draft: keep the KV of the last token and of the accepted draft
        tokens (the rejected ones' slots are past `computed_len`: overwritten later, never
        published to the tree), append the accepted tokens and the one sampled after them, one
        output each (so stops, `max_new_tokens` and the texts of both ends stay per token), and
        pace the request's drafts by how much was accepted."""
        accepted = res.accepted_ids
        req.add_computed(len(chunk.token_ids) - chunk.draft_len + len(accepted))
        req.spec_accepted += len(accepted)
        self.counters.spec_draft_tokens += chunk.draft_len
        self.counters.spec_accepted_tokens += len(accepted)
        req.spec.pace.record(chunk.draft_len, len(accepted))
        tokens = [*accepted, res.next_token_id]
        logprobs = [*res.accepted_logprobs, res.logprob] if req.return_logprob else [0.0] * len(tokens)
        tops = [*res.accepted_top_logprobs, res.top_logprobs] if req.top_logprobs_num else [[]] * len(tokens)
        for token, logprob, top in zip(tokens, logprobs, tops, strict=True):
            self._append_token(req, token, logprob, top)
            if req.finished:
                return
        self.kv.cache_progress(req)

    def _append_token(self, req: Request, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        req.append_output(token)
        self.counters.generation_tokens += 1
        new_tokens = [token]  # one output, one stop-checker `add`: the front adds the same group
        if req.matcher is not None and not req.matcher.accept_token(token):
            # the worker masked the logits with this matcher's bitmask: only a bug gets here
            finish = FinishReason("abort", message=f"token {token} broke the request's grammar")
        else:
            finish = self._stop_reason(req, new_tokens)
        out = self._output(req, new_tokens, finish)
        if req.return_logprob:
            out.output_logprobs = [logprob]
            out.output_top_logprobs = [top] if req.top_logprobs_num else []
        if finish is not None:
            self._end(req, finish)
        self._outputs.append(out)

    def _stop_reason(self, req: Request, new_tokens: list[int]) -> FinishReason | None:
        """Why the sample ends with `new_tokens` (its last output), if it does.

        Before `min_new_tokens` nothing stops it: a stop string completed then is plain text (the
        checker still reads it, to keep its text the front's); only a match completed at or after
        `min_new_tokens` ends the sample, and its position is sent, so the front cuts at that one.
        """
        p = req.sampling
        token = new_tokens[-1]
        n_out = len(req.output_ids)
        checker = req.stop_checker
        if req.matcher is not None and req.matcher.is_terminated():
            return FinishReason("stop", matched=token)  # the grammar ended (on an EOS id): nothing may follow
        if n_out >= p.min_new_tokens:
            if token in p.stop_token_ids:
                return FinishReason("stop", matched=token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason("stop", matched=token)
            match = checker.check(new_tokens) if checker is not None else None
            if match is not None:
                return FinishReason("stop", matched=match.stop, stop_position=match.position)
        elif checker is not None:
            checker.check(new_tokens)
        if n_out >= p.max_new_tokens or req.fill_len >= self.context_len:
            return FinishReason("length")
        return None

    def _output(self, req: Request, tokens: list[int], finish: FinishReason | None) -> RequestOutput:
        out = RequestOutput(
            rid=req.rid, index=req.index, new_token_ids=tokens, prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens, finish=finish,
            spec_accepted_tokens=req.spec_accepted if self.speculative else None,
            segment_tokens=req.segment_tokens, recomputed_tokens=req.recomputed_tokens,
        )
        if req.prompt_logprobs is PromptLogprobs.COMPLETE:
            lead = 1 if req.logprob_start_len == 0 else 0  # the first prompt token has no logprob
            out.input_logprobs = [None] * lead + req.input_logprobs
            out.input_top_logprobs = [[]] * lead + req.input_top_logprobs
            req.prompt_logprobs_sent()
            self._prompt_logprobs_pending.discard(req.rid)
        return out

    def _finish(self, req: Request, finish: FinishReason) -> None:
        """End a request that produced no new token this step (abort, max_new_tokens 0)."""
        if req.computed_len >= len(req.input_ids):
            req.prompt_logprobs_complete()
        self._end(req, finish)
        if req.pin is not None:
            self._replies.append(self.pins.complete(req.pin, finish, req.cached_tokens))
            return
        if req.segment_fill:
            key = (req.namespace, tuple(req.input_ids))
            if self._fills.get(key) is req:
                del self._fills[key]
            return
        self._outputs.append(self._output(req, [], finish))

    def _end(self, req: Request, finish: FinishReason) -> None:
        if req in self.running:
            self.kv.release(req)
            self.running.remove(req)
        req.end(finish)
        if req.key in self._worker_keys:
            self._worker_keys.discard(req.key)
            self._finished_keys.append(req.key)
        if req.index == 0:
            self._prompt_logprobs_pending.discard(req.rid)  # sent, or never will be (abort)
