"""Segments: prompt spans whose KV is reused wherever they sit (the `segments` API; docs/cache.md).

A RAG prompt holds retrieved documents in a per-question order, so the prefix cache rarely
reuses them. A segment's KV is therefore also computed on its own, at positions 0.., by a
prompt-only *fill* request in the segment namespace of the request's cache namespace (so
tenants never share it), and kept in the radix tree like any prefix. A request using it
elsewhere copies those pages into its own with the keys re-rotated (the worker, worker/blend.py)
and recomputes a share of the copied tokens in context: the ones whose KV deviates most after
the first layers. This module plans that from the scheduler's side:

    prompt:  | instruction (prefix cache) | doc B (reused) | doc A (reused) | question |
             0                            ^ publish_limit

- what is reused: each span's tokens from the exact prefix on, as far as the segment cache
  holds whole pages of it; the runs are cut into *groups* of at most `group_tokens`, each
  recomputing `ceil(ratio * length)` tokens, and a prefill chunk never splits a group, so the
  output does not depend on how the scheduler chunks the prompt (a request resumed after a
  crash re-blends the same way);
- what is published: blended KV is this request's alone; only the exact prefix before the
  first reused token goes to the prefix cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from radixserve.cache.base import MatchResult, PrefixCache, TreeNode
from radixserve.protocol import SegmentReuse

MAX_GROUP_TOKENS = 128  # the most reused tokens one recompute selection ranks
# Before any namespace a tenant owns (those begin with the tenant's name). A salt spelling it in
# the shared namespace reaches KV that depends only on its tokens, as everything in the tree does.
_SEGMENT_ROOT = "\x00segments\x00"


def segment_namespace(namespace: str | None) -> str:
    """Where a namespace's segments live in the tree: their own root, derived from the
    request's namespace (a tenant's, or a client's salt within it), so tenants never share one."""
    return f"{_SEGMENT_ROOT}{namespace or ''}"


def segment_owner(namespace: str | None) -> tuple[str | None, bool]:
    """A tree namespace as a client names it: (its request namespace, whether it is that
    namespace's segment cache)."""
    if namespace is not None and namespace.startswith(_SEGMENT_ROOT):
        return namespace[len(_SEGMENT_ROOT):] or None, True
    return namespace, False


def group_tokens(chunk_size: int, admission_share: int) -> int:
    """Group size: at most MAX_GROUP_TOKENS, and no more than the share of a step's budget a
    short prefill is sure to get, so a group always fits in some step."""
    return max(1, min(MAX_GROUP_TOKENS, chunk_size // admission_share))


@dataclass
class BlendPlan:
    """A running request's reused runs (one selection group each) and the segment-cache nodes
    it locks while its prompt is computed."""

    runs: list[SegmentReuse]
    nodes: list[TreeNode] = field(default_factory=list)

    @property
    def start(self) -> int:
        """The first reused position: KV from here on is blended, not the prefix cache's."""
        return self.runs[0].position

    @property
    def end(self) -> int:
        last = self.runs[-1]
        return last.position + last.length

    @property
    def segment_tokens(self) -> int:
        return sum(r.length for r in self.runs)

    @property
    def recomputed_tokens(self) -> int:
        return sum(r.recompute for r in self.runs)

    def cut(self, start: int, end: int) -> int:
        """The furthest chunk end <= `end` that splits no group (start itself when the first
        group it meets begins at `start` and does not fit)."""
        for run in self.runs:
            if run.position < end < run.position + run.length:
                end = run.position
                break
        return max(start, end)

    def cost(self, start: int, end: int, copy_cost: float) -> float:
        """What computing positions [start, end) costs, in computed tokens: a copied token
        that is not recomputed costs `copy_cost`, every other token 1."""
        copied = sum(r.length - r.recompute for r in self.runs_in(start, end))
        return (end - start) - copied * (1.0 - copy_cost)

    def reach(self, start: int, end: int, budget: float, copy_cost: float) -> int:
        """The furthest chunk end in [start, end] whose tokens cost at most `budget` (`cost`),
        splitting no group: copies are cheap, so a step's budget covers more of a blend."""
        spent, at = 0.0, start
        for run in self.runs:
            if run.position + run.length <= at or at >= end:
                continue
            fresh = min(run.position, end) - at  # computed tokens before the group
            if fresh > 0:
                if spent + fresh > budget:
                    return at + max(0, int(budget - spent))
                spent, at = spent + fresh, at + fresh
            group = run.recompute + (run.length - run.recompute) * copy_cost
            if run.position + run.length > end or spent + group > budget:
                return at
            spent, at = spent + group, run.position + run.length
        return min(end, at + max(0, int(budget - spent)))

    def drop_after(self, computed: int) -> None:
        """Forget the groups not yet computed (their tokens are computed like any other)."""
        self.runs = [r for r in self.runs if r.position + r.length <= computed]

    def runs_in(self, start: int, end: int) -> list[SegmentReuse]:
        """The groups a chunk over positions [start, end) carries (each wholly inside it)."""
        return [r for r in self.runs if start <= r.position and r.position + r.length <= end]


def plan_blend(
    spans: list[tuple[int, int]], tokens: list[int], exact_len: int, limit: int, ratio: float,
    cache: PrefixCache, namespace: str | None, page_size: int, group: int,
) -> BlendPlan | None:
    """Match each span in the segment cache and lock what is reused; None when nothing is.

    `exact_len`: the prompt tokens the prefix cache matched (their KV is exact and stays);
    `limit`: no token at or past it is reused (the last prompt token, prompt logprobs).
    """
    ns = segment_namespace(namespace)
    runs: list[SegmentReuse] = []
    nodes: list[TreeNode] = []
    for begin, end in spans:
        first = max(begin, exact_len)
        if first >= min(end, limit):
            continue
        match: MatchResult = cache.match_prefix(tokens[begin:end], ns)
        stop = min(begin + match.length, end, limit)
        if stop <= first:
            continue
        cache.lock(match.node)
        nodes.append(match.node)
        # groups on fixed boundaries from the span's start, whatever the exact prefix covers
        at = first
        while at < stop:
            upto = min(stop, begin + ((at - begin) // group + 1) * group)
            length = upto - at
            pages = match.pages[: -(-(upto - begin) // page_size)]
            runs.append(SegmentReuse(at, length, at - begin, pages, math.ceil(ratio * length)))
            at = upto
    if not runs:
        for node in nodes:
            cache.unlock(node)
        return None
    return BlendPlan(runs, nodes)


def missing_spans(
    spans: list[tuple[int, int]], tokens: list[int], cache: PrefixCache, namespace: str | None, page_size: int,
) -> list[list[int]]:
    """The spans' token lists whose whole pages the segment cache does not hold yet (each once):
    the segments to fill. A span shorter than a page has nothing to cache."""
    ns = segment_namespace(namespace)
    missing: list[list[int]] = []
    for begin, end in spans:
        whole = (end - begin) - (end - begin) % page_size
        segment = tokens[begin:end]
        if whole and cache.peek_prefix_length(segment, ns) < whole and segment not in missing:
            missing.append(segment)
    return missing
