"""Which waiting request goes first: `lpm` (longest cached prefix first) or `fcfs`.

`lpm` also deduplicates: a waiting request that shares a not-yet-cached prefix with a request
being prefilled right now waits for that prefill to publish its pages, instead of computing
the same tokens a second time in the same batch.

Either way, requests that use segments and the segment fills they wait for (prompt-only
requests computing a segment alone; scheduler/segments.py) are taken soonest-ready first among
their own places: requests that can run, then the fills of the request with the fewest fill
tokens left. Requests then become ready one after another, not all at the end, as a
shortest-job-first queue would have them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixserve.cache.base import PrefixCache
from radixserve.scheduler.request import Request

LPM_MAX_QUEUE = 128  # past this, prefix matching every waiting request each step costs too much


def order_waiting(waiting: list[Request], policy: str, cache: PrefixCache) -> list[Request]:
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return order_fills(sorted(waiting, key=lambda r: r.arrival))
    hit = {id(r): cache.peek_prefix_length(r.fill_ids[: r.match_limit], r.namespace) for r in waiting}
    return order_fills(sorted(waiting, key=lambda r: (-hit[id(r)], r.arrival)))


def order_fills(ordered: list[Request]) -> list[Request]:
    """`ordered` with the requests that use segments and the segment fills permuted among their
    own places, soonest-ready first: a request by the fill tokens it still waits for (none: it
    can run), then by arrival; a fill as the soonest-ready request waiting for it. Requests
    without segments keep their places."""
    places = [i for i, r in enumerate(ordered) if r.segment_fill or r.fills]
    if len(places) < 2:
        return ordered
    key: dict[int, tuple[int, int, int]] = {}
    for req in ordered:
        if req.segment_fill or not req.fills:
            continue
        pending = [f for f in req.fills if not f.finished]
        own = (sum(f.fill_len - f.computed_len for f in pending), req.arrival)
        key[id(req)] = (*own, 1)
        for fill in pending:  # before the request itself, which waits for it
            key[id(fill)] = min(key.get(id(fill), (*own, 0)), (*own, 0))
    orphan = (1 << 62, 0, 0)  # a fill no waiting request needs any more
    moved = sorted((ordered[i] for i in places), key=lambda r: (key.get(id(r), orphan), r.arrival))
    result = list(ordered)
    for i, req in zip(places, moved, strict=True):
        result[i] = req
    return result


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def shares_uncached_prefix(
    req: Request, cached_len: int, prefilling: Iterable[Request], min_tokens: int
) -> bool:
    """True if a request being prefilled will soon publish >= `min_tokens` more of req's prefix."""
    for other in prefilling:
        if other.namespace != req.namespace:
            continue
        # a blend publishes only its exact prefix: what it reuses never reaches the cache
        common = min(common_prefix_len(req.input_ids, other.input_ids), other.publish_limit)
        if common - cached_len >= min_tokens:
            return True
    return False
