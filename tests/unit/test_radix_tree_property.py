"""Property tests: the radix tree driven by random operations against a naive reference model.

The reference model knows nothing about trees: it keeps every cached page-aligned prefix
``(namespace, tokens[:k * page_size])`` with its page id and last-use time, and answers each
question by brute force (scan all entries). After every operation the tree must agree with it
exactly: matched pages, inserted/duplicate pages, the pages each eviction frees (hence LRU order
among unlocked leaves), locks, stats, and page accounting.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixserve.cache import PageAllocator, RadixTree, TreeNode

Key = tuple[str | None, tuple[int, ...]]

# Prompts are prefixes of a few shared "documents" plus a short random tail, so that matches end
# inside edges, duplicates and partial overlaps are common, not lucky.
DOCUMENTS = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
    [0, 1, 2, 0, 1, 2, 1, 1, 1, 1, 1, 1],
    [0, 1, 2, 2, 2, 2, 0, 0, 0, 0],
    [1, 0, 1, 0, 1, 0, 1, 0],
]
TOKENS = st.builds(
    lambda doc, cut, tail: doc[:cut] + tail,
    st.sampled_from(DOCUMENTS),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=3),
)
NAMESPACES = st.sampled_from([None, "", "a", "b"])  # "" is the default namespace, like None


def norm(namespace: str | None) -> str | None:
    return namespace or None


class RecordingAllocator(PageAllocator):
    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.freed: list[int] = []

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        super().free(pages)
        self.freed += pages


class RefModel:
    """Naive reference: every cached page-aligned prefix -> [page id, last-use time]."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.entries: dict[Key, list[int]] = {}
        self.clock = 0
        self.locks: list[Key] = []  # one entry per lock held
        self.hit = 0
        self.miss = 0

    def prefixes(self, ns: str | None, tokens: list[int]) -> list[Key]:
        return [(ns, tuple(tokens[: (i + 1) * self.ps])) for i in range(len(tokens) // self.ps)]

    def cached_run(self, ns: str | None, tokens: list[int]) -> list[Key]:
        run = []
        for key in self.prefixes(ns, tokens):
            if key not in self.entries:
                break
            run.append(key)
        return run

    def match(self, ns: str | None, tokens: list[int]) -> tuple[list[int], int, Key | None]:
        run = self.cached_run(ns, tokens)
        self.clock += 1
        for key in run:
            self.entries[key][1] = self.clock
        length = len(run) * self.ps
        self.hit += length
        self.miss += len(tokens) - length
        return [self.entries[k][0] for k in run], length, (run[-1] if run else None)

    def insert(self, ns: str | None, tokens: list[int], pages: list[int]) -> tuple[int, list[int]]:
        """Returns (already cached tokens, the caller's duplicate pages, in order)."""
        self.clock += 1
        already = 0
        duplicates = []
        for i, key in enumerate(self.prefixes(ns, tokens)):
            if key in self.entries:
                assert already == i, "reference model lost prefix-closure"
                already = i + 1
                if self.entries[key][0] != pages[i]:
                    duplicates.append(pages[i])
                self.entries[key][1] = self.clock
            else:
                self.entries[key] = [pages[i], self.clock]
        return already * self.ps, duplicates

    def locked(self, key: Key) -> bool:
        ns, toks = key
        return any(lk[0] == ns and lk[1][: len(toks)] == toks for lk in self.locks)

    def is_leaf(self, key: Key) -> bool:
        ns, toks = key
        return not any(
            k[0] == ns and len(k[1]) == len(toks) + self.ps and k[1][: len(toks)] == toks
            for k in self.entries
        )

    def evict(self, n: int) -> list[int]:
        """Evict n pages one at a time: always the least recently used unlocked leaf page."""
        out = []
        for _ in range(n):
            candidates = [k for k in self.entries if self.is_leaf(k) and not self.locked(k)]
            if not candidates:
                break
            oldest = min(self.entries[k][1] for k in candidates)
            victims = [k for k in candidates if self.entries[k][1] == oldest]
            assert len(victims) == 1, "two LRU leaves share a time: the model is ambiguous"
            out.append(self.entries.pop(victims[0])[0])
        return out


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(4, 24))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.alloc = RecordingAllocator(num_pages)
        self.tree = RadixTree(page_size, self.alloc)
        self.model = RefModel(page_size)
        self.handles: list[tuple[TreeNode, Key | None]] = []  # locks held by "requests"
        self.held: list[list[int]] = []  # pages held by "running requests"

    # ---- helpers ----

    def _evict(self, n: int) -> None:
        mark = len(self.alloc.freed)
        got = self.tree.evict(n)
        expected = self.model.evict(n)
        assert got == len(expected)
        assert sorted(self.alloc.freed[mark:]) == sorted(expected)

    def _make_room(self, n: int) -> bool:
        if n > self.alloc.num_free:
            self._evict(n - self.alloc.num_free)
        return n <= self.alloc.num_free

    def _match(self, tokens: list[int], ns: str | None) -> tuple[TreeNode, list[int], Key | None]:
        m = self.tree.match_prefix(tokens, ns)
        pages, length, key = self.model.match(norm(ns), tokens)
        assert (m.pages, m.length) == (pages, length)
        assert len(m.pages) * self.ps == m.length
        return m.node, m.pages, key

    def _lock(self, node: TreeNode, key: Key | None) -> None:
        self.tree.lock(node)
        if key is not None:
            self.model.locks.append(key)
        self.handles.append((node, key))

    def _unlock(self, index: int) -> None:
        node, key = self.handles.pop(index)
        self.tree.unlock(node)
        if key is not None:
            self.model.locks.remove(key)

    def _pages_needed(self, tokens: list[int]) -> int:
        return -(-len(tokens) // self.ps)  # the partial last page too

    # ---- rules ----

    @rule(tokens=TOKENS, ns=NAMESPACES, lock=st.booleans())
    def match(self, tokens: list[int], ns: str | None, lock: bool) -> None:
        node, _, key = self._match(tokens, ns)
        if lock:
            self._lock(node, key)

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def peek(self, tokens: list[int], ns: str | None) -> None:
        expected = len(self.model.cached_run(norm(ns), tokens)) * self.ps
        assert self.tree.peek_prefix_length(tokens, ns) == expected

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 1000))
    def unlock(self, i: int) -> None:
        self._unlock(i % len(self.handles))

    @rule(tokens=TOKENS, ns=NAMESPACES, reuse=st.booleans())
    def finish_request(self, tokens: list[int], ns: str | None, reuse: bool) -> None:
        """A request ends. With `reuse` it had matched and locked a prefix and passes those
        pages back at the front; otherwise it computed everything in fresh pages."""
        own: list[int] = []
        if reuse:
            node, own, key = self._match(tokens, ns)
            self._lock(node, key)
        fresh = self._pages_needed(tokens) - len(own)
        if self._make_room(fresh):
            pages = own + self.alloc.alloc(fresh)
            mark = len(self.alloc.freed)
            r = self.tree.insert(tokens, pages, ns)
            already, duplicates = self.model.insert(norm(ns), tokens, pages)
            assert r.already_cached == already
            assert r.freed_pages == len(duplicates)
            assert self.alloc.freed[mark:] == duplicates
            self.alloc.free(pages[len(tokens) // self.ps :])  # the caller's unaligned tail
        if reuse:
            self._unlock(len(self.handles) - 1)

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def cache_running_request(self, tokens: list[int], ns: str | None) -> None:
        """A request keeps running after caching what it computed so far (insert_and_lock)."""
        need = self._pages_needed(tokens)
        if not self._make_room(need):
            return
        pages = self.alloc.alloc(need)
        mark = len(self.alloc.freed)
        m = self.tree.insert_and_lock(tokens, pages, ns)
        _, duplicates = self.model.insert(norm(ns), tokens, pages)
        run = self.model.prefixes(norm(ns), tokens)
        assert (m.pages, m.length) == ([self.model.entries[k][0] for k in run], len(run) * self.ps)
        assert self.alloc.freed[mark:] == duplicates
        self.tree.unlock(m.node)  # re-lock through the helper so the model tracks it
        self._lock(m.node, run[-1] if run else None)
        tail = pages[len(run) :]
        if tail:
            self.held.append(tail)

    @rule(k=st.integers(1, 3))
    def hold_pages(self, k: int) -> None:
        if k <= self.alloc.num_free:
            self.held.append(self.alloc.alloc(k))

    @precondition(lambda self: self.held)
    @rule()
    def release_pages(self) -> None:
        self.alloc.free(self.held.pop(0))

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        self._evict(n)

    @rule()
    def flush(self) -> None:
        mark = len(self.alloc.freed)
        got = self.tree.flush()
        expected = self.model.evict(len(self.model.entries))
        assert got == len(expected)
        assert sorted(self.alloc.freed[mark:]) == sorted(expected)

    # ---- after every step ----

    @invariant()
    def agrees_with_model(self) -> None:
        self.tree.check()
        self.alloc.check()
        s = self.tree.stats()
        held = sum(len(b) for b in self.held)
        assert self.alloc.num_free + s.cached_pages + held == self.alloc.total
        assert s.cached_pages == len(self.model.entries)
        assert s.locked_pages == sum(1 for k in self.model.entries if self.model.locked(k))
        assert s.evictable_pages == s.cached_pages - s.locked_pages
        assert (s.hit_tokens, s.miss_tokens) == (self.model.hit, self.model.miss)

    @invariant()
    def locked_paths_survive(self) -> None:
        for node, key in self.handles:
            assert node.alive
            if key is not None:
                assert key in self.model.entries
                assert self.tree.peek_prefix_length(list(key[1]), key[0]) >= len(key[1])

    @invariant()
    def namespaces_never_cross(self) -> None:
        for ns, root in self.tree._roots.items():
            stack, tree_pages = [root], set()
            while stack:
                node = stack.pop()
                assert node.namespace == ns
                tree_pages.update(node.pages)
                stack.extend(node.children.values())
            model_pages = {v[0] for k, v in self.model.entries.items() if k[0] == ns}
            assert tree_pages == model_pages
        assert {k[0] for k in self.model.entries} <= set(self.tree._roots)


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase


# ---- the match property stated directly over cached sequences (no eviction) -------------------


def aligned_lcp(a: list[int], b: list[int], page_size: int) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % page_size


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    sequences=st.lists(st.lists(st.integers(0, 3), max_size=40), max_size=8),
    queries=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=8),
)
def test_match_is_the_longest_aligned_common_prefix_with_a_cached_sequence(
    page_size: int, sequences: list[list[int]], queries: list[list[int]]
) -> None:
    alloc = PageAllocator(8 * 40)
    tree = RadixTree(page_size, alloc)
    for seq in sequences:
        pages = alloc.alloc(-(-len(seq) // page_size))
        tree.insert(seq, pages)
        alloc.free(pages[len(seq) // page_size :])
    for query in queries + sequences:
        expected = max((aligned_lcp(query, s, page_size) for s in sequences), default=0)
        assert tree.peek_prefix_length(query) == expected
        assert tree.match_prefix(query).length == expected
        tree.check()
