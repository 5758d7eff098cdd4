"""A request as the scheduler tracks it: tokens, progress, and the KV pages it holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.base import TreeNode
from radixserve.protocol import FinishReason, SamplingParams


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
    # constrained decoding: the compile this sample waits for, then its own matcher (an
    # xgrammar GrammarMatcher that has accepted every output token; it survives retraction)
    grammar_wait: Any = None  # scheduler.grammar.PendingGrammar while compiling
    matcher: Any = None
    # KV state, valid while running
    row: int | None = None
    pages: list[int] = field(default_factory=list)
    node: TreeNode | None = None
    tree_len: int = 0
    computed_len: int = 0
    # reporting
    cached_tokens: int = 0  # matched in the tree at first admission (never chunk self-hits)
    admitted: bool = False
    worker_knows: bool = False  # the worker holds this request's sampling state
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs_done: bool = False
    input_logprobs_sent: bool = False
    finish: FinishReason | None = None
    abort_requested: bool = False
    # a suspect of the last engine crash (TokenizedRequest.isolate): scheduled in steps of its
    # own until it samples a token
    isolated: bool = False
    # speculative decoding: the sample's drafter (scheduler/ngram.py) and the pace of its drafts
    # (scheduler/draft_pace.py), both made at its first draft, and how many of its draft tokens
    # were accepted
    drafter: Any = None
    draft_pace: Any = None
    spec_accepted: int = 0
    # the disk tier (scheduler/disk_tier.py): the keys of its pages, computed once, and whether
    # its pages on disk were read ahead while it waited
    page_keys: list[bytes] = field(default_factory=list)
    disk_planned: bool = False
    # a prefix to pin (protocol.PinPrefix): computed as a prompt-only request, then held
    pin: Any = None
    created: float = field(default_factory=time.monotonic)

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
    def is_prefilling(self) -> bool:
        """More than the last sampled token is still to compute (prompt, or a resumed context)."""
        return self.computed_len < self.fill_len - 1

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob
            and 0 <= self.logprob_start_len < len(self.input_ids)
            and not self.input_logprobs_done
        )

    @property
    def match_limit(self) -> int:
        """How much of fill_ids may come from the cache: prompt logprobs need their logits computed."""
        if self.wants_input_logprobs:
            return max(self.logprob_start_len, 1) - 1
        return self.fill_len - 1  # the last token is always computed, to get next-token logits

    def reset_kv(self) -> None:
        """Forget KV state (after retraction): it will be matched and computed again."""
        self.row, self.pages, self.node, self.tree_len, self.computed_len = None, [], None, 0, 0
        self.disk_planned = False
        if self.wants_input_logprobs:
            self.input_logprobs, self.input_top_logprobs = [], []
