"""The prefix-cache interface the scheduler programs against, its result types, and `NoCache`.

Two implementations share this interface: `RadixTree` (radix_tree.py) and `NoCache` below, used
for ``--disable-radix-cache``. The scheduler calls the same methods either way; with `NoCache`
nothing is ever matched and every page handed to `insert` goes straight back to the allocator.

Page ownership, the one rule to get right (see `PrefixCache.insert`):

    tokens:  | t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49 t50 |      (page_size 16)
    pages:   |    p0     |    p1     |    p2     |     p3      |
             '------- aligned part: consumed by insert --------'-- stays the caller's --'

After ``insert(tokens, pages)`` the caller no longer owns ``pages[:len(tokens) // page_size]``:
the cache adopted them or freed them (when it already held the same tokens in other pages). The
caller still owns, and must free, ``pages[len(tokens) // page_size:]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.cache.allocator import PageAllocator


class TreeNode:
    """A radix tree node: one edge of token ids (whole pages) and the KV pages holding them.

    For callers this is an opaque handle naming "the cached prefix that ends here"; pass it to
    `lock` / `unlock` and nothing else. The handle stays valid (names the same tokens) across
    edge splits; once the node is evicted, `lock` on it raises `ValueError`.
    """

    __slots__ = (
        "key",
        "pages",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "evicted",
        "namespace",
        "page_keys",
    )

    def __init__(
        self,
        key: bytes,
        pages: list[int],
        parent: TreeNode | None,
        namespace: str | None,
        last_access: int = 0,
    ) -> None:
        self.key = key  # token ids as packed 4-byte ints; len(key) == 4 * page_size * len(pages)
        self.pages = pages
        self.children: dict[bytes, TreeNode] = {}  # keyed by the child's first page of key
        self.parent = parent  # None for a namespace root
        self.lock_ref = 0  # locks on this node + sum of the children's lock_ref
        self.last_access = last_access  # logical clock of the last match/insert through here
        self.evicted = False
        self.namespace = namespace
        # the disk tier's key of each page (cache/disk_index.py), computed when first needed
        self.page_keys: list[bytes] | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.evicted

    @property
    def alive(self) -> bool:
        """False once evicted: a `MatchResult` holding this node is stale, match again."""
        return not self.evicted

    def __repr__(self) -> str:
        return (
            f"TreeNode(pages={self.pages}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached page-aligned prefix of a token sequence.

    ``pages`` are owned by the cache. They are safe to use only while ``node`` is locked: lock it
    before anything can evict (before the next `evict`, `insert` or `flush`).
    """

    pages: list[int]  # KV pages of tokens[:length], in order; len(pages) == length // page_size
    length: int  # matched tokens, a multiple of page_size
    node: TreeNode  # lock this to keep `pages` alive; a root when nothing matched


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What `insert` did with the caller's aligned pages (all of which it consumed)."""

    already_cached: int  # leading tokens that were in the cache before this call
    freed_pages: int  # caller's duplicate pages the cache returned to the allocator


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache, in pages and lifetime token counters."""

    cached_pages: int  # pages held by the cache
    evictable_pages: int  # cached pages on unlocked nodes (cached - locked)
    locked_pages: int  # cached pages on nodes with a lock count > 0
    hit_tokens: int  # sum of matched lengths over all match_prefix calls
    miss_tokens: int  # sum of (len(tokens) - matched length) over all match_prefix calls


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache. All methods are synchronous and not
    thread-safe; the scheduler process is their only caller.

    ``namespace`` (a request's ``cache_salt``): ``None`` and ``""`` are the shared default; any
    other string gets its own subtree, and entries of different namespaces never share nodes, so a
    request can only hit prefixes inserted under its own namespace.
    """

    page_size: int
    allocator: PageAllocator

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None) -> MatchResult:
        """Find the longest cached page-aligned prefix of ``tokens``.

        Mutates: may split an edge so the match ends on a node; refreshes the LRU time of the
        matched path; adds to hit/miss counters. Does not lock: call `lock(result.node)` before
        the next evict/insert/flush if you will use ``result.pages``. Safe on an empty cache and
        on empty or shorter-than-a-page ``tokens`` (length 0, a root node).
        """

    @abstractmethod
    def peek_prefix_length(self, tokens: Sequence[int], namespace: str | None = None) -> int:
        """Length of the longest cached page-aligned prefix, without modifying anything.

        No split, no LRU refresh, no hit/miss counting: for scheduling policies (e.g. longest
        prefix match ordering) that look at many waiting requests every step.
        """

    @abstractmethod
    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> InsertResult:
        """Hand a computed sequence to the cache; the caller is done with its pages.

        ``pages`` must cover at least the aligned part: ``len(pages) >= len(tokens) // page_size``.
        The cache consumes ``pages[:len(tokens) // page_size]``: pages of tokens it did not hold
        are adopted; pages of tokens it already held are freed to the allocator, except pages that
        *are* the cache's own (a request that matched, locked and reused a prefix passes those
        back unchanged; they stay cached). The caller keeps ``pages[len(tokens) // page_size:]``
        and must free them itself. Unlock the request's matched node *after* this call.

        Raises `ValueError`, having changed nothing, if ``pages`` is too short, a page it would
        adopt or free is not allocated, is already the cache's (at another position), or repeats.
        """

    @abstractmethod
    def insert_and_lock(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> MatchResult:
        """Like `insert`, for a request that keeps running (e.g. after a prefill chunk).

        Returns the pages that now hold ``tokens[:aligned]`` and a node already locked for the
        caller: replace ``pages[:len(result.pages)]`` with ``result.pages`` in the request (they
        differ where the cache held the tokens already and freed the caller's copy), then unlock
        the request's previous node. Unlock ``result.node`` when the request ends, after its final
        `insert`.
        """

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Protect the path from the root to ``node`` from eviction (reference counted).

        A no-op on a root. Raises `ValueError` if ``node`` was evicted (the match is stale).
        """

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises `ValueError` if ``node`` is not locked."""

    @abstractmethod
    def evict(self, n_pages: int) -> int:
        """Free ``min(n_pages, evictable_pages)`` pages to the allocator; returns how many.

        Least recently used unlocked leaves go first, deepest pages of a leaf first; a leaf is
        split when only part of it is needed, so exactly the asked number is freed.
        """

    @abstractmethod
    def flush(self) -> int:
        """Evict everything that is not locked (``/flush_cache``); returns pages freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages `evict` could free right now."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """A snapshot of page counts and lifetime hit/miss token counters."""

    @abstractmethod
    def check(self) -> None:
        """Verify internal invariants; raise `RuntimeError` on the first violation (debug/tests)."""


def aligned_pages(n_tokens: int, page_size: int) -> int:
    """Whole pages in ``n_tokens`` tokens: only these are ever cached."""
    return n_tokens // page_size


def normalize_namespace(namespace: str | None) -> str | None:
    """Map ``None`` and ``""`` to the default namespace (``None``); reject non-strings."""
    if namespace is None or namespace == "":
        return None
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a str or None, got {type(namespace).__name__}")
    return namespace


def validate_page_size(page_size: int) -> int:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    return page_size


class NoCache(PrefixCache):
    """The cache turned off (``--disable-radix-cache``): same interface, caches nothing.

    `match_prefix` always returns length 0 on a root node (lock/unlock on it are no-ops); `insert`
    frees every aligned page it is given; `insert_and_lock` leaves the caller's pages with the
    caller (returns them unchanged), so the final `insert` frees them; `evict` frees nothing;
    stats are all zero (the scheduler's own prompt-token counters carry the misses).
    """

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        self.page_size = validate_page_size(page_size)
        self.allocator = allocator
        self._root = TreeNode(b"", [], None, None)

    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None) -> MatchResult:
        normalize_namespace(namespace)
        return MatchResult([], 0, self._root)

    def peek_prefix_length(self, tokens: Sequence[int], namespace: str | None = None) -> int:
        normalize_namespace(namespace)
        return 0

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> InsertResult:
        consumed = self._consumed(tokens, pages, namespace)
        self.allocator.free(consumed)
        return InsertResult(already_cached=0, freed_pages=len(consumed))

    def insert_and_lock(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> MatchResult:
        consumed = self._consumed(tokens, pages, namespace)
        return MatchResult(consumed, len(consumed) * self.page_size, self._root)

    def _consumed(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None
    ) -> list[int]:
        normalize_namespace(namespace)
        n = aligned_pages(len(tokens), self.page_size)
        if len(pages) < n:
            raise ValueError(f"{len(tokens)} tokens need {n} pages, got {len(pages)}")
        return list(pages[:n])

    def lock(self, node: TreeNode) -> None:
        if node is not self._root:
            raise ValueError("NoCache.lock: node does not belong to this cache")

    def unlock(self, node: TreeNode) -> None:
        if node is not self._root:
            raise ValueError("NoCache.unlock: node does not belong to this cache")

    def evict(self, n_pages: int) -> int:
        if not isinstance(n_pages, int) or n_pages < 0:
            raise ValueError(f"evict: n_pages must be an int >= 0, got {n_pages!r}")
        return 0

    def flush(self) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(0, 0, 0, 0, 0)

    def check(self) -> None:
        if self._root.children or self._root.pages:
            raise RuntimeError("NoCache root holds entries")
