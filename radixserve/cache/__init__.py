"""KV page bookkeeping for the scheduler: the page allocator and the prefix caches.

Pure Python, no torch: the worker owns the KV tensors, this package only decides which page ids
are free, which a request holds and which the radix tree keeps. See docs/cache.md.
"""

from __future__ import annotations

from radixserve.cache.allocator import OutOfPages, PageAllocator
from radixserve.cache.base import (
    CacheStats,
    InsertResult,
    MatchResult,
    NoCache,
    PrefixCache,
    TreeNode,
)
from radixserve.cache.radix_tree import RadixTree

__all__ = [
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "NoCache",
    "OutOfPages",
    "PageAllocator",
    "PrefixCache",
    "RadixTree",
    "TreeNode",
]
