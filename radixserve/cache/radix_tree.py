"""Radix tree prefix cache over whole KV pages (RadixAttention-style), pure Python.

Each edge is a run of whole pages of token ids, stored as packed bytes (4 bytes per token), with
the page ids holding their KV. Children are keyed by the bytes of their edge's first page, so a
child lookup is one dict probe and an edge compare is one ``bytes.startswith`` (memcmp); where an
edge matches only partly, a binary search over page boundaries finds the common pages. Python
never loops over tokens, and dict keys are the exact token bytes, never a hash of them.

A match (or insert) that ends inside an edge splits it, so the matched part is a node of its own
that can be locked. The existing node object keeps the lower part, so a handle to it still names
the same prefix:

    before: match [A B] against the edge [A B C D]       after:
      (root)                                              (root)
        |  key A B C D, pages p0 p1 p2 p3                   |  key A B, pages p0 p1   <- new node
        v                                                   v
       [X]                                                 [U] ---- returned, lockable
                                                            |  key C D, pages p2 p3
                                                            v
                                                           [X]  (same object, same children)

Eviction keeps a min-heap of (last_access, seq, node) for unlocked leaves, with lazy
invalidation: an entry is skipped when its node was evicted, gained children, got locked or was
accessed since (its timestamp moved). Time is a logical clock ticked by every match/insert, so
order is deterministic. Each op touches one root path, so no two leaves ever share a timestamp.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.base import (
    CacheStats,
    InsertResult,
    MatchResult,
    PrefixCache,
    TreeNode,
    normalize_namespace,
    validate_page_size,
)
from radixserve.cache.disk_index import chain_keys

_TOKEN_BYTES = 4
_TYPECODE = next(code for code in "IL" if array(code).itemsize == _TOKEN_BYTES)


def pack_tokens(tokens: Sequence[int], n: int) -> bytes:
    """The first ``n`` token ids as packed unsigned 4-byte ints (one C-level conversion)."""
    if isinstance(tokens, (bytes, bytearray, memoryview, str)):
        raise ValueError("tokens must be a sequence of ints, not bytes or str")
    try:
        packed = array(_TYPECODE, tokens).tobytes()
    except (TypeError, OverflowError) as err:
        raise ValueError(f"token ids must be ints in [0, 2**32): {err}") from None
    return packed if n == len(tokens) else packed[: n * _TOKEN_BYTES]


@dataclass(slots=True)
class _Walk:
    """Where a key's walk down the tree stopped (no mutation made)."""

    path: list[TreeNode]  # nodes whose whole edge matched, from the root's child down
    matched: int  # bytes of the key matched by `path`
    partial: TreeNode | None  # the next node, if its edge matched only partly
    partial_pages: int  # whole pages of `partial`'s edge that matched (>= 1 if partial)


class RadixTree(PrefixCache):
    """The prefix cache: a radix tree of page-aligned token runs that owns its KV pages.

    The tree holds pages adopted by `insert` until `evict`/`flush` returns them to ``allocator``
    itself. See `PrefixCache` for each method's contract; costs: `match_prefix`, `insert` and
    `peek_prefix_length` are O(nodes on the path + matched pages) with page/token comparisons in
    C; `lock`/`unlock` O(depth in nodes); `evict` O(log heap) per leaf freed.
    """

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        self.page_size = validate_page_size(page_size)
        self.allocator = allocator
        self._page_bytes = page_size * _TOKEN_BYTES
        # One root per namespace; the default (None) always exists, others while non-empty.
        self._roots: dict[str | None, TreeNode] = {None: TreeNode(b"", [], None, None)}
        self._clock = 0
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()
        self._num_nodes = 0  # non-root nodes
        self._cached_pages = 0
        self._locked_pages = 0
        self._owned: set[int] = set()  # every page the tree holds, for validation and check()
        self._hit_tokens = 0
        self._miss_tokens = 0
        # the disk tier (scheduler/kv.py): the start of a namespace's page-key chain, and what
        # to do with a leaf's pages before `evict` frees them (write them back); None: no tier
        self.namespace_key: Callable[[str | None], bytes] | None = None
        self.spill: Callable[[TreeNode], None] | None = None

    # ---- lookups ---------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None) -> MatchResult:
        ns = normalize_namespace(namespace)
        n_tokens = len(tokens)
        key = pack_tokens(tokens, n_tokens - n_tokens % self.page_size)
        root = self._roots.get(ns)
        if root is None or not key:
            self._miss_tokens += n_tokens
            return MatchResult([], 0, root if root is not None else TreeNode(b"", [], None, ns))
        walk = self._walk(root, key)
        path = walk.path
        matched = walk.matched
        if walk.partial is not None:
            upper = self._split(walk.partial, walk.partial_pages)
            path.append(upper)
            matched += len(upper.key)
        length = matched // _TOKEN_BYTES
        self._hit_tokens += length
        self._miss_tokens += n_tokens - length
        if not path:
            return MatchResult([], 0, root)
        self._touch(path)
        pages: list[int] = []
        for node in path:
            pages += node.pages
        return MatchResult(pages, length, path[-1])

    def peek_prefix_length(self, tokens: Sequence[int], namespace: str | None = None) -> int:
        root = self._roots.get(normalize_namespace(namespace))
        key = pack_tokens(tokens, len(tokens) - len(tokens) % self.page_size)
        if root is None or not key:
            return 0
        walk = self._walk(root, key)
        return (walk.matched + walk.partial_pages * self._page_bytes) // _TOKEN_BYTES

    def _walk(self, root: TreeNode, key: bytes) -> _Walk:
        """Follow ``key`` (page-aligned bytes) down from ``root`` as far as whole pages match."""
        step = self._page_bytes
        node = root
        pos = 0
        end = len(key)
        path: list[TreeNode] = []
        while pos < end:
            child = node.children.get(key[pos : pos + step])
            if child is None:
                break
            edge = child.key
            if key.startswith(edge, pos):
                path.append(child)
                pos += len(edge)
                node = child
            else:
                return _Walk(path, pos, child, self._common_pages(edge, key, pos))
        return _Walk(path, pos, None, 0)

    def _common_pages(self, edge: bytes, key: bytes, pos: int) -> int:
        """Whole pages ``edge`` shares with ``key[pos:]``, given that the first page matches.

        Binary search on page boundaries: O(log pages) memcmps, no copies (memoryview slices).
        """
        step = self._page_bytes
        view = memoryview(edge)
        lo = 1
        hi = min(len(edge), len(key) - pos) // step
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key.startswith(view[: mid * step], pos):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- insertion -------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> InsertResult:
        _, already_cached, freed = self._insert(tokens, pages, namespace)
        return InsertResult(already_cached=already_cached, freed_pages=freed)

    def insert_and_lock(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> MatchResult:
        path, _, _ = self._insert(tokens, pages, namespace)
        if not path:
            ns = normalize_namespace(namespace)
            root = self._roots.get(ns)
            return MatchResult([], 0, root if root is not None else TreeNode(b"", [], None, ns))
        node = path[-1]
        self.lock(node)
        tree_pages: list[int] = []
        for x in path:
            tree_pages += x.pages
        return MatchResult(tree_pages, len(tree_pages) * self.page_size, node)

    def _insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: str | None
    ) -> tuple[list[TreeNode], int, int]:
        """Shared body of the inserts: (path root->end, already cached tokens, pages freed)."""
        ns = normalize_namespace(namespace)
        n_pages = len(tokens) // self.page_size
        if len(pages) < n_pages:
            raise ValueError(
                f"{len(tokens)} tokens at page size {self.page_size} need at least {n_pages} "
                f"pages, got {len(pages)}"
            )
        key = pack_tokens(tokens, n_pages * self.page_size)
        if n_pages == 0:
            return [], 0, 0
        if type(pages) is not list:
            pages = list(pages)
        root = self._roots.get(ns)
        if root is None:
            root = TreeNode(b"", [], None, ns)
        walk = self._walk(root, key)
        duplicates = self._duplicates(walk, pages)
        cached = walk.matched // self._page_bytes + walk.partial_pages
        new_pages = pages[cached:n_pages]
        self._validate_handover(duplicates, new_pages)  # also adds new_pages to self._owned

        # Validated: from here on nothing raises.
        self._roots.setdefault(ns, root)
        path = walk.path
        if walk.partial is not None:
            path.append(self._split(walk.partial, walk.partial_pages))
        if new_pages:
            parent = path[-1] if path else root
            start = cached * self._page_bytes
            leaf = TreeNode(key[start:], new_pages, parent, ns)
            parent.children[key[start : start + self._page_bytes]] = leaf
            self._num_nodes += 1
            self._cached_pages += len(new_pages)
            path.append(leaf)
        self._touch(path)
        if duplicates:
            self.allocator.free(duplicates)
        return path, cached * self.page_size, len(duplicates)

    def _duplicates(self, walk: _Walk, pages: list[int]) -> list[int]:
        """Caller's pages for the already-cached range that are not the tree's own pages there."""
        duplicates: list[int] = []
        offset = 0
        segments = [node.pages for node in walk.path]
        if walk.partial is not None:
            segments.append(walk.partial.pages[: walk.partial_pages])
        for tree_pages in segments:
            end = offset + len(tree_pages)
            mine = pages[offset:end]
            if mine != tree_pages:
                duplicates += [p for p, q in zip(mine, tree_pages, strict=True) if p != q]
            offset = end
        return duplicates

    def _validate_handover(self, duplicates: list[int], new_pages: list[int]) -> None:
        """Claim ``new_pages`` for the tree, or raise with nothing changed.

        Pages to free or adopt must be allocated, distinct, and not already the tree's. The
        ownership check for new pages rides on the set update that adopting them needs anyway
        (at page size 1 a 4k-page insert pays one pass over a large set, not three); on failure
        the owned set is rebuilt from the tree, which only the error path pays for.
        """
        if duplicates:
            if not self.allocator.all_allocated(duplicates):
                self._raise_not_allocated(duplicates)
            if not self._owned.isdisjoint(duplicates):
                self._raise_owned(duplicates)
            if len(set(duplicates)) != len(duplicates) or not set(duplicates).isdisjoint(new_pages):
                raise ValueError("insert: a page id appears twice in pages")
        if not new_pages:
            return
        if not self.allocator.all_allocated(new_pages):
            self._raise_not_allocated(new_pages)
        owned = self._owned
        before = len(owned)
        owned.update(new_pages)
        if len(owned) != before + len(new_pages):
            self._owned = self._collect_pages()
            self._raise_owned(new_pages)
            raise ValueError("insert: a page id appears twice in pages")

    def _raise_not_allocated(self, pages: list[int]) -> None:
        bad = next(p for p in pages if not self.allocator.is_allocated(p))
        raise ValueError(f"insert: page {bad!r} is not allocated")

    def _raise_owned(self, pages: list[int]) -> None:
        bad = next((p for p in pages if p in self._owned), None)
        if bad is not None:
            raise ValueError(f"insert: page {bad} already belongs to the cache at another position")

    def _collect_pages(self) -> set[int]:
        """Every page held by the tree, by traversal (O(tree)); for error recovery and check()."""
        pages: set[int] = set()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            pages.update(node.pages)
            stack.extend(node.children.values())
        return pages

    def _split(self, node: TreeNode, n_pages: int) -> TreeNode:
        """Cut ``node``'s edge after ``n_pages`` pages; the new upper node is returned.

        ``node`` keeps the lower part, its children and its heap entries, so handles to it stay
        valid. Page counters do not change: both halves carry ``node``'s lock count.
        """
        cut = n_pages * self._page_bytes
        parent = node.parent
        if parent is None:
            raise ValueError("cannot split a root")
        upper = TreeNode(node.key[:cut], node.pages[:n_pages], parent, node.namespace)
        upper.last_access = node.last_access
        upper.lock_ref = node.lock_ref
        if node.page_keys is not None:
            upper.page_keys, node.page_keys = node.page_keys[:n_pages], node.page_keys[n_pages:]
        parent.children[node.key[: self._page_bytes]] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
        node.parent = upper
        upper.children[node.key[: self._page_bytes]] = node
        self._num_nodes += 1
        return upper

    def _touch(self, path: list[TreeNode]) -> None:
        """Refresh the LRU time of a root path (root's child first)."""
        self._clock += 1
        now = self._clock
        for node in path:
            node.last_access = now
        last = path[-1]
        if not last.children and not last.lock_ref:
            self._push(last)

    # ---- locking ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        if node.evicted:
            raise ValueError("lock: node was evicted; the match is stale, match again")
        while node.parent is not None:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if node.parent is None and not node.evicted:
            return
        if node.lock_ref <= 0:
            raise ValueError("unlock: node is not locked (unlock without a matching lock)")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
                if not node.children:
                    self._push(node)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, n_pages: int) -> int:
        return self._evict(n_pages, self.spill)

    def _evict(self, n_pages: int, spill: Callable[[TreeNode], None] | None) -> int:
        if not isinstance(n_pages, int) or n_pages < 0:
            raise ValueError(f"evict: n_pages must be an int >= 0, got {n_pages!r}")
        heap = self._heap
        freed: list[int] = []
        need = n_pages
        while need > 0 and heap:
            stamp, _, node = heapq.heappop(heap)
            if node.evicted or node.children or node.lock_ref or node.last_access != stamp:
                continue  # stale entry
            if len(node.pages) > need:
                self._split(node, len(node.pages) - need)  # evict only the deepest pages
            if spill is not None:
                spill(node)
            freed += node.pages
            need -= len(node.pages)
            self._remove_leaf(node)
        if freed:
            self._owned.difference_update(freed)
            self.allocator.free(freed)
        return len(freed)

    def flush(self) -> int:
        """Drops, never writes back: a flush empties the cache, it does not move it to disk."""
        return self._evict(self.evictable_pages, None)

    def page_keys(self, node: TreeNode) -> list[bytes]:
        """The disk tier's keys of ``node``'s pages (cache/disk_index.py), computed once per
        node from its parent's last key: a chain over every token from the namespace root."""
        if self.namespace_key is None:
            raise RuntimeError("page_keys: this tree has no disk tier")
        pending: list[TreeNode] = []
        x = node
        while x.parent is not None and x.page_keys is None:
            pending.append(x)
            x = x.parent
        previous = self.namespace_key(x.namespace) if x.parent is None else x.page_keys[-1]
        for x in reversed(pending):
            x.page_keys = chain_keys(previous, x.key, self._page_bytes)
            previous = x.page_keys[-1]
        return node.page_keys

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        if parent is None:
            raise RuntimeError("internal: tried to evict a root")
        del parent.children[node.key[: self._page_bytes]]
        node.evicted = True
        self._num_nodes -= 1
        self._cached_pages -= len(node.pages)
        if parent.parent is not None:
            if not parent.children and not parent.lock_ref:
                self._push(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # drop empty tenant subtrees

    def _push(self, node: TreeNode) -> None:
        heap = self._heap
        heapq.heappush(heap, (node.last_access, next(self._seq), node))
        if len(heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop stale and duplicate entries in place (amortised O(1) per push)."""
        live: dict[int, tuple[int, int, TreeNode]] = {}
        for entry in self._heap:
            stamp, _, node = entry
            if not (node.evicted or node.children or node.lock_ref or node.last_access != stamp):
                live[id(node)] = entry
        self._heap[:] = live.values()
        heapq.heapify(self._heap)

    # ---- stats and checks ------------------------------------------------------------------

    @property
    def evictable_pages(self) -> int:
        return self._cached_pages - self._locked_pages

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, roots excluded (for stats and benchmarks)."""
        return self._num_nodes

    def stats(self) -> CacheStats:
        return CacheStats(
            cached_pages=self._cached_pages,
            evictable_pages=self._cached_pages - self._locked_pages,
            locked_pages=self._locked_pages,
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
        )

    def check(self) -> None:
        """Verify structure, counters, page ownership and heap coverage. O(nodes + pages)."""
        seen_pages: list[int] = []
        num_nodes = 0
        locked_pages = 0
        evictable_leaves: list[TreeNode] = []
        if None not in self._roots:
            raise RuntimeError("the default namespace root is missing")
        for ns, root in self._roots.items():
            if root.parent is not None or root.key or root.pages or root.evicted:
                raise RuntimeError(f"namespace {ns!r}: malformed root")
            if root.namespace != ns:
                raise RuntimeError(f"namespace {ns!r}: root labelled {root.namespace!r}")
            if ns is not None and not root.children:
                raise RuntimeError(f"namespace {ns!r}: empty subtree was not dropped")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for first, child in node.children.items():
                    self._check_node(node, first, child, ns)
                    child_locks += child.lock_ref
                    num_nodes += 1
                    seen_pages += child.pages
                    if child.lock_ref:
                        locked_pages += len(child.pages)
                    elif not child.children:
                        evictable_leaves.append(child)
                    stack.append(child)
                if node.parent is not None and node.lock_ref < child_locks:
                    raise RuntimeError("a node's lock count is below its children's sum")
        self._check_counters(seen_pages, num_nodes, locked_pages)
        live = {(id(node), stamp) for stamp, _, node in self._heap}
        for leaf in evictable_leaves:
            if (id(leaf), leaf.last_access) not in live:
                raise RuntimeError("an evictable leaf has no live heap entry")

    def _check_node(self, parent: TreeNode, first: bytes, node: TreeNode, ns: str | None) -> None:
        if node.parent is not parent or node.evicted:
            raise RuntimeError("broken parent link or evicted node in the tree")
        if node.namespace != ns:
            raise RuntimeError(f"node of namespace {node.namespace!r} under {ns!r}")
        if not node.pages or len(node.key) != len(node.pages) * self._page_bytes:
            raise RuntimeError("edge key length does not match its pages")
        if node.key[: self._page_bytes] != first:
            raise RuntimeError("child keyed by bytes that are not its first page")
        if node.lock_ref < 0:
            raise RuntimeError("negative lock count")
        if parent.parent is not None and parent.last_access < node.last_access:
            raise RuntimeError("a child was accessed after its parent")
        if node.last_access > self._clock:
            raise RuntimeError("a node's time is ahead of the clock")

    def _check_counters(self, seen_pages: list[int], num_nodes: int, locked_pages: int) -> None:
        if len(set(seen_pages)) != len(seen_pages):
            raise RuntimeError("a page is held by two nodes")
        if set(seen_pages) != self._owned:
            raise RuntimeError("owned-page set disagrees with the tree")
        if not self.allocator.all_allocated(seen_pages):
            raise RuntimeError("the tree holds a page the allocator considers free")
        if num_nodes != self._num_nodes:
            raise RuntimeError(f"node count {self._num_nodes} != actual {num_nodes}")
        if len(seen_pages) != self._cached_pages:
            raise RuntimeError(f"cached_pages {self._cached_pages} != actual {len(seen_pages)}")
        if locked_pages != self._locked_pages:
            raise RuntimeError(f"locked_pages {self._locked_pages} != actual {locked_pages}")

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"RadixTree(page_size={self.page_size}, cached_pages={s.cached_pages}, "
            f"locked_pages={s.locked_pages}, nodes={self._num_nodes})"
        )
