"""A request as the scheduler tracks it: tokens, progress, the KV pages it holds, and where it
stands in its life (`RequestPhase`).

    WAITING_FOR_GRAMMAR --grammar_compiled--> WAITING --admit--> PREFILLING --progress--> DECODING
            |                                   ^ '--admit (all but the last token cached)--> DECODING
            |                                   '------------ retract (PREFILLING, DECODING) ----'
            '--end--> FINISHED <--end (stop, length, abort: from any phase but FINISHED)

The phase changes only through the methods below; each checks the move is legal and raises
`IllegalTransition` naming both ends, so a bookkeeping bug fails where it happens instead of
steps later in the page accounting. A retracted request goes back to WAITING and keeps its
output tokens: it resumes through the cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.cache.base import TreeNode
from radixserve.protocol import FinishReason, PinPrefix, SamplingParams
from radixserve.scheduler.draft_pace import DraftPace
from radixserve.scheduler.ngram import NgramDrafter
from radixserve.scheduler.stop import StopChecker

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from radixserve.scheduler.grammar import PendingGrammar
    from radixserve.scheduler.segments import BlendPlan


class RequestPhase(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued while its grammar compiles
    WAITING = "waiting"  # queued, ready to admit (a retracted request comes back here)
    PREFILLING = "prefilling"  # running: more than the last token is still to compute
    DECODING = "decoding"  # running: one token a step (and a draft, with speculation)
    FINISHED = "finished"  # ended: `finish` says why; nothing holds it any more


_LEGAL: dict[RequestPhase, frozenset[RequestPhase]] = {
    RequestPhase.WAITING_FOR_GRAMMAR: frozenset({RequestPhase.WAITING, RequestPhase.FINISHED}),
    # admission goes straight to DECODING when the cache held all but the last token
    RequestPhase.WAITING: frozenset({RequestPhase.PREFILLING, RequestPhase.DECODING, RequestPhase.FINISHED}),
    RequestPhase.PREFILLING: frozenset({RequestPhase.DECODING, RequestPhase.WAITING, RequestPhase.FINISHED}),
    RequestPhase.DECODING: frozenset({RequestPhase.WAITING, RequestPhase.FINISHED}),
    RequestPhase.FINISHED: frozenset(),
}
RUNNING = frozenset({RequestPhase.PREFILLING, RequestPhase.DECODING})


class IllegalTransition(RuntimeError):
    """A phase change the lifecycle does not allow: a scheduler bug, never a client's error."""


class PromptLogprobs(enum.Enum):
    """The prompt's logprobs (sample 0 of a request that asked for them from a position on)."""

    NOT_ASKED = "not_asked"
    COLLECTING = "collecting"  # computed chunk by chunk; a retraction starts them again
    COMPLETE = "complete"  # all computed, not yet sent
    SENT = "sent"  # in an output already


@dataclass
class Speculation:
    """One sample's speculative decoding: its drafter (scheduler/ngram.py) and the pace of its
    drafts (scheduler/draft_pace.py), made at its first draft."""

    drafter: NgramDrafter
    pace: DraftPace


@dataclass(eq=False)
class Request:
    """One sample of one client request (a request with n > 1 becomes n of these).

    KV layout while running (page_size 4):

        fill_ids:  | prompt ............................. | output ... |
        pages:     | p3 | p9 | p1 | p6 | p2 |
                   '-- tree_len: the tree's, locked --'
                   '------- computed_len: KV stored -------'

    `pages[: tree_len // page_size]` belong to the radix tree and are locked through `node`; the
    rest belong to the request alone. A retracted request drops all KV state but keeps its
    output tokens, and resumes later through the cache.

    The sample's decoding helpers live here and survive retraction: its stop checker, its
    grammar matcher (which has accepted every output token) and its drafter.
    """

    rid: int  # the front's internal id of the submission (never a client's rid)
    index: int  # sample index within the client request
    input_ids: list[int]
    sampling: SamplingParams
    namespace: str | None
    arrival: int  # arrival order, for fcfs and for choosing retraction victims
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    # constrained decoding: the compile this sample waits for (WAITING_FOR_GRAMMAR), then its
    # own matcher
    grammar_wait: PendingGrammar | None = None
    matcher: GrammarMatcher | None = None
    stop_checker: StopChecker | None = None  # with stop strings
    spec: Speculation | None = None  # with speculative decoding, from its first draft
    spec_accepted: int = 0  # draft tokens accepted
    # KV state, valid while running
    row: int | None = None
    pages: list[int] = field(default_factory=list)
    node: TreeNode | None = None
    tree_len: int = 0
    computed_len: int = 0
    # reporting
    cached_tokens: int = 0  # matched in the tree at first admission (never chunk self-hits)
    admitted: bool = False  # once admitted (by this engine or, resumed, by the last): counted
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None  # why it ended, set with FINISHED
    # a suspect of the last engine crash (TokenizedRequest.isolate): scheduled in steps of its
    # own until it samples a token
    isolated: bool = False
    # the disk tier (scheduler/disk_tier.py): the keys of its pages, computed once, and whether
    # its pages on disk were read ahead while it waited
    page_keys: list[bytes] = field(default_factory=list)
    disk_planned: bool = False
    pin: PinPrefix | None = None  # a prefix to pin: computed as a prompt-only request, then held
    # segments (scheduler/segments.py): the prompt's reusable spans and the share of their
    # tokens recomputed; the fills it waits for before its first admission; while running, the
    # plan of what it reuses (`blend`, made at admission)
    segments: list[tuple[int, int]] = field(default_factory=list)
    recompute_ratio: float = 0.0
    fills: list[Request] = field(default_factory=list)
    blend: BlendPlan | None = None
    segment_fill: bool = False  # a segment computed alone for the segment cache: no client waits on it
    segment_tokens: int = 0  # reported, like cached_tokens: reused at first admission
    recomputed_tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    _phase: RequestPhase = field(init=False, repr=False)
    prompt_logprobs: PromptLogprobs = field(init=False)

    def __post_init__(self) -> None:
        self._phase = RequestPhase.WAITING if self.grammar_wait is None else RequestPhase.WAITING_FOR_GRAMMAR
        asked = self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)
        self.prompt_logprobs = PromptLogprobs.COLLECTING if asked else PromptLogprobs.NOT_ASKED

    # ------------------------------------------------------------------ phase

    @property
    def phase(self) -> RequestPhase:
        return self._phase

    @property
    def running(self) -> bool:
        return self._phase in RUNNING

    @property
    def finished(self) -> bool:
        return self._phase is RequestPhase.FINISHED

    @property
    def waits_for_grammar(self) -> bool:
        return self._phase is RequestPhase.WAITING_FOR_GRAMMAR

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is still to compute (prompt, or a resumed context)."""
        return self._phase is RequestPhase.PREFILLING

    def _move(self, to: RequestPhase, only_from: frozenset[RequestPhase] | None = None) -> None:
        """Change phase, if the lifecycle allows `to` from here (and the caller's step starts in
        one of `only_from`: `admit` from PREFILLING to DECODING is no progress, for one)."""
        if to not in _LEGAL[self._phase] or (only_from is not None and self._phase not in only_from):
            raise IllegalTransition(f"request {self.key}: {self._phase.name} -> {to.name} is not a legal transition")
        self._phase = to

    def _compute_phase(self) -> RequestPhase:
        return RequestPhase.PREFILLING if self.computed_len < self.fill_len - 1 else RequestPhase.DECODING

    def grammar_compiled(self, matcher: GrammarMatcher) -> None:
        """WAITING_FOR_GRAMMAR -> WAITING: its grammar compiled; the matcher is its own."""
        self._move(RequestPhase.WAITING, only_from=frozenset({RequestPhase.WAITING_FOR_GRAMMAR}))
        self.matcher, self.grammar_wait = matcher, None

    def admit(self) -> bool:
        """WAITING -> PREFILLING (or DECODING, when the cache held all but the last token):
        it holds its KV pages and row now. True at its first admission (to count it once)."""
        self._move(self._compute_phase(), only_from=frozenset({RequestPhase.WAITING}))
        first, self.admitted = not self.admitted, True
        return first

    def add_computed(self, n: int) -> None:
        """`n` more tokens' KV are stored: PREFILLING -> DECODING once only the last is left."""
        self.computed_len += n
        self._follow_progress()

    def append_output(self, token: int) -> None:
        """A sampled token; a crash suspect that samples has cleared itself."""
        self.output_ids.append(token)
        self.isolated = False
        if self.prompt_logprobs is PromptLogprobs.COLLECTING:
            self.prompt_logprobs = PromptLogprobs.COMPLETE
        self._follow_progress()

    def _follow_progress(self) -> None:
        if self.running and self._compute_phase() is not self._phase:
            self._move(self._compute_phase())

    def retract(self) -> None:
        """PREFILLING/DECODING -> WAITING, its KV state dropped (`reset_kv`); output kept."""
        self._move(RequestPhase.WAITING, only_from=RUNNING)

    def end(self, finish: FinishReason) -> None:
        """Any live phase -> FINISHED, for `finish`'s reason."""
        self._move(RequestPhase.FINISHED)
        self.finish = finish

    # ------------------------------------------------------------------ prompt logprobs

    @property
    def wants_input_logprobs(self) -> bool:
        return self.prompt_logprobs is PromptLogprobs.COLLECTING

    def prompt_logprobs_complete(self) -> None:
        """Every prompt logprob asked for is computed (a request ending without a token)."""
        if self.prompt_logprobs is PromptLogprobs.COLLECTING:
            self.prompt_logprobs = PromptLogprobs.COMPLETE

    def prompt_logprobs_sent(self) -> None:
        self.prompt_logprobs = PromptLogprobs.SENT

    # ------------------------------------------------------------------ tokens and KV

    @property
    def key(self) -> str:
        """The worker's name for this sample, unique among live samples: `rid` is an int no client
        writes, so `f"{rid}#{index}"` can never be another request's key."""
        return f"{self.rid}#{self.index}"

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def match_limit(self) -> int:
        """How much of fill_ids may come from the cache: prompt logprobs need their logits computed."""
        if self.wants_input_logprobs:
            return max(self.logprob_start_len, 1) - 1
        return self.fill_len - 1  # the last token is always computed, to get next-token logits

    @property
    def publish_limit(self) -> int:
        """Tokens whose KV may go to the prefix cache: the exact prefix before a blend's first
        reused token (blended KV is this request's alone), else all of them."""
        return self.blend.start if self.blend is not None else self.fill_len

    @property
    def waits_for_fills(self) -> bool:
        return any(not fill.finished for fill in self.fills)

    def reset_kv(self) -> None:
        """Forget KV state (after retraction): it will be matched and computed again."""
        self.row, self.pages, self.node, self.tree_len, self.computed_len = None, [], None, 0, 0
        self.blend = None
        self.disk_planned = False
        if self.wants_input_logprobs:
            self.input_logprobs, self.input_top_logprobs = [], []
