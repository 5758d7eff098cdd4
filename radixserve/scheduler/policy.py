"""Which waiting request goes first: `lpm` (longest cached prefix first) or `fcfs`.

`lpm` also deduplicates: a waiting request that shares a not-yet-cached prefix with a request
being prefilled right now waits for that prefill to publish its pages, instead of computing
the same tokens a second time in the same batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixserve.cache.base import PrefixCache
from radixserve.scheduler.request import Request

LPM_MAX_QUEUE = 128  # past this, prefix matching every waiting request each step costs too much


def order_waiting(waiting: list[Request], policy: str, cache: PrefixCache) -> list[Request]:
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: r.arrival)
    hit = {id(r): cache.peek_prefix_length(r.fill_ids[: r.match_limit], r.namespace) for r in waiting}
    return sorted(waiting, key=lambda r: (-hit[id(r)], r.arrival))


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
