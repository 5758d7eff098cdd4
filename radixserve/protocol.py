"""Every message between radixserve's processes, as msgspec Structs encoded with msgpack.

No torch in here and no pickle anywhere: a socket only ever carries these types.
"""

from __future__ import annotations

import msgspec

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# upper bounds (seconds) of the grammar compile-time histogram the scheduler keeps and the front exports
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Grammar(msgspec.Struct, frozen=True):
    """A decoding constraint, compiled by the scheduler (xgrammar): `kind` is one of
    `GRAMMAR_KINDS` and `text` its source (a JSON schema, a regex, EBNF, a structural tag's JSON)."""

    kind: str
    text: str


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick the next token, and when to stop. Validated by the front before it travels.

    temperature 0 means greedy (exact argmax). Penalties follow the usual conventions:
    `repetition_penalty` (multiplicative, over prompt and output tokens, 1.0 = off),
    `frequency_penalty` / `presence_penalty` (additive, over output tokens, 0.0 = off).
    `top_k` 0 or -1 = off, `top_p` 1.0 = off, `min_p` 0.0 = off. `logit_bias` adds its value to
    the logit of each token id before sampling (greedy included), as OpenAI's `logit_bias` does.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = {}
    grammar: Grammar | None = None  # only tokens the grammar allows are sampled (greedy included)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )


class Shutdown(msgspec.Struct, tag=True):
    """Stop the receiving process cleanly."""


# --------------------------------------------------------------------------- front -> scheduler


class ResumedSample(msgspec.Struct, array_like=True, omit_defaults=True):
    """One unfinished sample of a request submitted again to a fresh engine after a crash.

    `output_groups` are the sample's `RequestOutput.new_token_ids` the front received, in order:
    the new scheduler replays them into its stop checker one `add` each, so its text (and every
    later `stop_position`) stays the front's, then continues from their last token. The worker
    gets them as output tokens, so penalties and a seeded sample's step go on where they were.
    """

    index: int  # which of the request's n samples
    output_groups: list[list[int]] = []
    cached_tokens: int = 0  # what the first engine reported; the client keeps seeing it
    segment_tokens: int = 0  # likewise (RequestOutput.segment_tokens)
    recomputed_tokens: int = 0


class TokenizedRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """A validated, tokenized request.

    `rid` is the front's internal id for this one submission: an int from a counter, never reused
    and never written by a client. A client's rid is only a label the front maps to it, so no
    client can name another's request, an earlier request's late outputs, or one sample of a
    request (the scheduler and worker key sample i as `f"{rid}#{i}"`).
    """

    rid: int
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned; -1 = none
    top_logprobs_num: int = 0
    cache_salt: str | None = None  # cache namespace (tenant); None = the shared namespace
    # after an engine restart (front/recovery.py): only these samples, each from its tokens so
    # far; empty = a new request, all n samples from the start
    resume: list[ResumedSample] = []
    # the request was in the step that crashed the last engine: it runs in steps of its own until
    # it samples a token, so a second crash names it alone (a poison request)
    isolate: bool = False
    # reusable segments (the `segments` API, docs/cache.md): token spans [start, end) of
    # input_ids, in order and apart, whose KV may come from the segment cache wherever they sit;
    # empty = an ordinary prompt
    segments: list[tuple[int, int]] = []
    segment_recompute_ratio: float = 0.15  # share of reused tokens recomputed (front resolves the default)


class AbortRequest(msgspec.Struct, tag=True):
    """Stop a request, all its samples (client went away, or asked); pages are freed at the next step."""

    rid: int  # the front's internal id (TokenizedRequest.rid)


class FlushCache(msgspec.Struct, tag=True):
    """Drop every unlocked cached prefix. Answered with `FlushCacheDone`."""

    req_id: int


class GetStats(msgspec.Struct, tag=True):
    """Ask the scheduler for its counters. Answered with `SchedulerStats`; doubles as a liveness probe."""

    req_id: int


PIN_TIERS = ("memory", "disk")


class PinPrefix(msgspec.Struct, tag=True, omit_defaults=True):
    """Compute a prefix if it is not cached, and keep its pages from eviction (``POST
    /cache/pin``): in the KV pool ("memory"), or in the disk tier ("disk": it is loaded back
    when used, like any page on disk). Answered with `PinDone`."""

    req_id: int
    input_ids: list[int]
    cache_salt: str | None = None  # the cache namespace, as for a request
    tier: str = "memory"  # one of PIN_TIERS
    ttl: float | None = None  # seconds; None: until unpinned
    # the caller's tenant of --api-key-file (None without one): its pins count against that
    # tenant's budgets (scheduler/pins.py)
    tenant: str | None = None
    # pin `input_ids` as a segment: its KV computed alone, in the segment cache of the namespace
    # (scheduler/segments.py), for requests that reuse it wherever it sits
    segment: bool = False


class UnpinPrefix(msgspec.Struct, tag=True, omit_defaults=True):
    """Release pins: those of `pin_ids`, and those of exactly this prefix in this namespace
    (when `input_ids` is given). Answered with `PinList` (the pins released)."""

    req_id: int
    pin_ids: list[int] = []
    input_ids: list[int] = []
    cache_salt: str | None = None
    segment: bool = False  # `input_ids` is a pinned segment (PinPrefix.segment)


class ListPins(msgspec.Struct, tag=True):
    """Ask for every pin (the front shows a tenant only its own). Answered with `PinList`."""

    req_id: int


FrontToScheduler = (
    TokenizedRequest | AbortRequest | FlushCache | GetStats | PinPrefix | UnpinPrefix | ListPins | Shutdown
)


# --------------------------------------------------------------------------- scheduler -> front


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a sample ended, decided by the scheduler alone: the front only reports it.

    For a stop string, `stop_position` is where the match begins in the sample's output text, in
    characters: the text `detokenizer.output_detokenizer` builds from the sample's outputs, one
    `add(new_token_ids)` per `RequestOutput` in order, which both the scheduler's stop checker
    and the front build. The match completes within the text of this output's tokens, so it lies
    wholly in the text before `finish()`. The front cuts the text there (unless `no_stop_trim`);
    it never searches for the string, which may also occur earlier (before `min_new_tokens`).
    """

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string, for type "stop"
    message: str | None = None  # why, for "abort"
    stop_position: int | None = None  # for a stop string: where it begins in the output text


class RequestOutput(msgspec.Struct, omit_defaults=True, array_like=True):
    """What happened to one request in one step: new tokens, and how it ended if it did."""

    rid: int  # the front's internal id (TokenizedRequest.rid)
    index: int  # which of the request's n samples
    new_token_ids: list[int]  # one detokenizer `add` at both ends (see FinishReason.stop_position)
    prompt_tokens: int
    cached_tokens: int
    finish: FinishReason | None = None
    output_logprobs: list[float] = []
    output_top_logprobs: list[list[tuple[int, float]]] = []
    # The prompt's logprobs are the submission's, computed once: they come with the first output
    # of sample 0 only, before any output of samples 1..n-1 (which the scheduler admits after it).
    # The first prompt token's is None.
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[list[tuple[int, float]]] = []
    # with speculative decoding on: the sample's draft tokens accepted so far (None: off)
    spec_accepted_tokens: int | None = None
    # segments: prompt tokens whose KV came from the segment cache (counted in cached_tokens too),
    # and how many of those were recomputed through every layer
    segment_tokens: int = 0
    recomputed_tokens: int = 0


class TokenBatchOut(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]


class EngineFailed(msgspec.Struct, tag=True):
    """The scheduler's last word when a step failed (an exception in it, or the worker's): why,
    and the submissions of the failing step, the suspects of a poison request. The scheduler
    exits after sending it; a process killed outright sends nothing."""

    message: str
    suspects: list[int]  # internal ids (TokenizedRequest.rid) of the requests in that step


class RequestRejected(msgspec.Struct, tag=True):
    """The scheduler refused a request it cannot serve (queue full, too large for the pool).

    Also sent, with the request's rid, when a request failed after admission.
    """

    rid: int  # the front's internal id (TokenizedRequest.rid)
    message: str
    retryable: bool = False  # True: try again later (queue full), maps to HTTP 503


class FlushCacheDone(msgspec.Struct, tag=True):
    req_id: int
    freed_pages: int
    ok: bool  # False when requests were running (their pages stay cached)


class SchedulerStats(msgspec.Struct, tag=True):
    req_id: int
    num_running: int
    num_waiting: int
    total_pages: int
    free_pages: int
    cached_pages: int  # held by the radix tree (evictable or locked)
    evictable_pages: int  # held by the radix tree and by no running request: reclaimable
    running_pages: int  # held by running requests: their own, and the tree's they lock
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    generation_tokens_total: int
    num_retractions_total: int
    last_step_time: float  # time.time() of the last finished forward (0 if none)
    grammar_compiles_total: int = 0  # grammars compiled (cache misses)
    grammar_cache_hits_total: int = 0  # grammar requests served by the compiled-grammar cache
    grammar_compile_buckets: list[int] = []  # cumulative counts per GRAMMAR_COMPILE_BUCKETS bound, then +Inf
    grammar_compile_seconds_sum: float = 0.0
    spec_draft_tokens_total: int = 0  # draft tokens proposed for verification
    spec_accepted_tokens_total: int = 0  # of those, accepted
    # the disk tier (--kv-disk-dir), all 0 without it
    cached_prompt_tokens_disk_total: int = 0  # of cached_prompt_tokens_total, loaded from disk
    kv_disk_pages: int = 0
    kv_disk_bytes: int = 0
    kv_disk_capacity_bytes: int = 0
    kv_disk_stored_bytes_total: int = 0  # written back (KV payload bytes)
    kv_disk_loaded_bytes_total: int = 0  # loaded into the pool
    kv_disk_store_seconds_total: float = 0.0  # the writer thread's time in writes
    kv_disk_load_seconds_total: float = 0.0  # the worker's time copying loads into the pool
    kv_disk_corrupt_pages_total: int = 0  # files dropped for a bad size, header or checksum
    pinned_tokens_memory: int = 0  # tokens of the pages pins hold in the KV pool
    pinned_tokens_disk: int = 0  # tokens of the pages pins hold in the disk tier
    segment_reused_tokens_total: int = 0  # prompt tokens whose KV came from the segment cache
    segment_recomputed_tokens_total: int = 0  # of those, recomputed through every layer
    worker_threads: int = 0  # the threads the worker's last forward ran on; 0: none yet


class PinInfo(msgspec.Struct, omit_defaults=True):
    pin_id: int
    cache_salt: str | None  # the namespace it was pinned in
    tokens: int  # tokens pinned: the prefix's whole pages
    tier: str
    created: float  # time.time()
    expires_at: float | None = None  # time.time() when its ttl ends; None: never
    segment: bool = False  # a segment pinned in the segment cache of `cache_salt`


class PinDone(msgspec.Struct, tag=True, omit_defaults=True):
    """A `PinPrefix` answered: the pin, or why there is none (`error`, the client's mistake or
    a full pin budget)."""

    req_id: int
    pin: PinInfo | None = None
    cached_tokens: int = 0  # of the prefix, found cached (memory or disk) before computing
    error: str | None = None
    # with `error`, why: "refused", it cannot be held (a budget is full, the tier is missing);
    # "queue_full", the waiting queue is full (retry later); "pins_in_flight", the tenant has its
    # bound of pins queued or computing (retry once one is answered)
    refusal: str = "refused"


class PinList(msgspec.Struct, tag=True):
    req_id: int
    pins: list[PinInfo]


class WorkerInfo(msgspec.Struct, frozen=True):
    """What the worker loaded: told to the scheduler (`WorkerReady`), which passes it on to the
    front (`SchedulerReady`) to validate requests and describe the server."""

    total_pages: int
    page_size: int
    context_len: int  # max tokens of one request (prompt + output)
    vocab_size: int
    eos_token_ids: list[int]
    model_path: str
    dtype: str
    device: str
    cpu_isa: str  # the CPU ISA tier the worker's kernels use (kernels/isa.py)
    # what a copied segment token that is not recomputed costs a blend, as a share of a computed
    # token (it runs through the first layers only: worker/blend.py); step budgets count it so
    blend_copy_cost: float = 1.0
    # what each token of context a computed token attends to adds to its work, as a share of the
    # token's work in the linear layers (ModelConfig.context_token_cost); the step budget counts
    # it (scheduler/step_cost.py); 0 counts tokens alone
    context_token_cost: float = 0.0
    kv_cache_dtype: str = "auto"  # what the KV pool stores (--kv-cache-dtype resolved: never auto)
    # how the weights are held (models/loader.py): "gguf Q4_1+Q8_0" (the GGUF types kept quantized
    # for the CPU kernels), or "none" (dequantized to `dtype`)
    weight_format: str = "none"


class SchedulerReady(msgspec.Struct, tag=True):
    """Sent once the worker has loaded the model."""

    worker: WorkerInfo


SchedulerToFront = (
    TokenBatchOut | RequestRejected | FlushCacheDone | SchedulerStats | SchedulerReady | EngineFailed
    | PinDone | PinList
)


# --------------------------------------------------------------------------- scheduler <-> worker


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker has not seen: its sampling settings, once."""

    rid: str  # the sample's key, `f"{rid}#{index}"` (scheduler Request.key)
    sampling: SamplingParams
    top_logprobs_num: int = 0
    prompt_ids: list[int] = []  # only when a repetition penalty needs the whole prompt
    return_logprob: bool = False  # the sampled tokens' logprobs are wanted (else not computed)
    output_ids: list[int] = []  # a resumed sample's tokens so far (ResumedSample), once


class SegmentReuse(msgspec.Struct, array_like=True):
    """A run of a chunk's tokens whose KV is copied from a cached segment instead of computed
    (segment blending, docs/cache.md), and the selection group of its recompute.

    Tokens at request positions `position .. position + length - 1` take the K/V that the
    segment cache holds at the segment's own positions `source_position ..`, in the segment's
    `pages` (all of them from its first, so the source slot of segment position p is
    `pages[p // page_size] * page_size + p % page_size`), keys re-rotated by
    `position - source_position`. Of these tokens the worker recomputes the `recompute` whose
    K/V deviate most from the copied ones after the first layers; the rest keep the copies.
    """

    position: int
    length: int
    source_position: int
    pages: list[int]
    recompute: int


class Chunk(msgspec.Struct, array_like=True, omit_defaults=True):
    """Tokens of one request to compute this step, at positions prefix_len .. prefix_len+len-1."""

    rid: str  # the sample's key (NewRequest.rid)
    row: int
    prefix_len: int
    token_ids: list[int]
    sample: bool  # the chunk ends the request's known tokens: sample the next one
    input_logprobs_from: int = -1  # return logprobs of the chunk's tokens from this offset on
    next_token_id: int = -1  # token after the chunk, target of its last position's input logprob
    # speculative decoding: the chunk's last `draft_len` tokens are a draft to verify; the worker
    # samples after each of its last draft_len + 1 positions while the draws match the draft
    draft_len: int = 0
    # constrained sampling: the tokens allowed next, one bit per token id (little-endian int32
    # words, xgrammar's layout); empty = any token
    token_bitmask: bytes = b""
    # segment blending: runs of the chunk's tokens whose KV comes from the segment cache, in
    # position order, each wholly inside the chunk; never with a draft or input logprobs
    reuse: list[SegmentReuse] = []


class DiskOps(msgspec.Struct, array_like=True, omit_defaults=True):
    """The disk tier's work in one step (worker/kv_disk.py), done before the forward in this
    order: `store` copies pages out of the pool (their ids may be reused by this step) to be
    written, `load` copies pages read ahead into pool pages, then the reads, drops and deletes
    are queued. Keys are page keys (cache/disk_index.py)."""

    store: list[tuple[int, bytes]] = []  # (pool page, key): evicted from memory, write it back
    load: list[tuple[int, bytes]] = []  # (pool page, key): a page reported ready, into the pool
    prefetch: list[bytes] = []  # read these ahead for waiting requests
    unstage: list[bytes] = []  # read ahead but no longer wanted: free the host copy
    delete: list[bytes] = []  # evicted from the disk tier


class DiskReport(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the worker's disk threads finished since the last step, and their counters."""

    ready: list[bytes] = []  # read ahead and checked: may be loaded
    failed: list[bytes] = []  # missing or corrupt (deleted): compute them instead
    lost: list[bytes] = []  # a write failed: not on disk
    stored_bytes: int = 0  # lifetime totals from here on
    loaded_bytes: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    corrupt_pages: int = 0  # files dropped for a bad size, header or checksum


class ForwardBatch(msgspec.Struct, tag=True, omit_defaults=True):
    """One step's work, as diffs against what the worker already knows. O(batch), not O(context).

    The worker applies, in order: `released` rows, `new_requests`, `assigned` rows (whole page
    lists, for admitted or resumed requests), `appended` pages, then runs `chunks`.
    """

    chunks: list[Chunk]
    new_requests: list[NewRequest] = []
    assigned: list[tuple[int, list[int]]] = []  # (row, its pages), replacing what the row held
    appended: list[tuple[int, list[int]]] = []  # (row, pages added at the end)
    released: list[int] = []  # rows whose requests left; their worker state is dropped
    finished: list[str] = []  # sample keys whose sampling state can be dropped
    disk: DiskOps | None = None  # the disk tier's work, done before the forward


class ChunkResult(msgspec.Struct, array_like=True, omit_defaults=True):
    next_token_id: int = -1  # when the chunk sampled
    logprob: float = 0.0  # of next_token_id under the model's distribution, when return_logprob
    top_logprobs: list[tuple[int, float]] = []
    # a chunk with a draft: the draft tokens the worker's own draws matched, in order (the
    # token after them is next_token_id), with their logprobs
    accepted_ids: list[int] = []
    accepted_logprobs: list[float] = []
    accepted_top_logprobs: list[list[tuple[int, float]]] = []
    input_logprobs: list[float] = []  # for input_logprobs_from .. end of chunk
    input_top_logprobs: list[list[tuple[int, float]]] = []


class ForwardResult(msgspec.Struct, tag=True):
    results: list[ChunkResult]  # one per chunk, in order
    forward_time: float
    disk: DiskReport | None = None  # with --kv-disk-dir
    threads: int = 0  # the threads the forward ran on (a CPU worker may give some up: thread_governor.py); 0: not told


class WorkerReady(msgspec.Struct, tag=True):
    info: WorkerInfo  # the front gets this too (SchedulerReady)
    # with --kv-disk-dir: the start of every page-key chain (cache/disk_index.py), the pages
    # its directory holds (least recently used first) and what one costs on disk
    kv_model_key: bytes = b""
    disk_pages: list[bytes] = []
    disk_page_bytes: int = 0


class WorkerFailed(msgspec.Struct, tag=True):
    """The worker could not start or run a step; it exits after sending this."""

    message: str


SchedulerToWorker = ForwardBatch | Shutdown
WorkerToScheduler = ForwardResult | WorkerReady | WorkerFailed
