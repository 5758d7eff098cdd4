"""Unit tests for the radix tree and NoCache: tiny pools, exact page ids, exact eviction order."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from radixserve.cache import (
    CacheStats,
    InsertResult,
    NoCache,
    PageAllocator,
    RadixTree,
)


class RecordingAllocator(PageAllocator):
    """A PageAllocator that remembers every free() call, to assert exact freed ids."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.freed: list[list[int]] = []

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        super().free(pages)
        self.freed.append(pages)


def toks(symbols: str, page_size: int) -> list[int]:
    """One page of tokens per symbol: 'AB' at page size 2 -> [65, 65, 66, 66]."""
    return [ord(s) for s in symbols for _ in range(page_size)]


def make(page_size: int, num_pages: int = 16) -> tuple[RadixTree, RecordingAllocator]:
    alloc = RecordingAllocator(num_pages)
    return RadixTree(page_size, alloc), alloc


def check_all(tree: RadixTree, held: int = 0) -> None:
    tree.check()
    tree.allocator.check()
    a = tree.allocator
    assert a.num_free + tree.stats().cached_pages + held == a.total


PAGE_SIZES = [1, 2, 16]


# ---- basics ------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_empty_tree(ps: int) -> None:
    tree, alloc = make(ps)
    m = tree.match_prefix(toks("ABC", ps))
    assert (m.pages, m.length) == ([], 0)
    assert m.node.is_root
    tree.lock(m.node)  # no-op on a root
    tree.unlock(m.node)
    tree.unlock(m.node)  # still a no-op: roots are never locked
    assert tree.evict(5) == 0
    assert tree.flush() == 0
    assert tree.stats() == CacheStats(0, 0, 0, 0, 3 * ps)
    check_all(tree)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_then_match_returns_exact_pages(ps: int) -> None:
    tree, alloc = make(ps)
    pages = alloc.alloc(3)
    assert tree.insert(toks("ABC", ps), pages) == InsertResult(already_cached=0, freed_pages=0)
    m = tree.match_prefix(toks("ABC", ps))
    assert (m.pages, m.length) == ([0, 1, 2], 3 * ps)
    m = tree.match_prefix(toks("ABD", ps))
    assert (m.pages, m.length) == ([0, 1], 2 * ps)
    m = tree.match_prefix(toks("ABCDE", ps))
    assert (m.pages, m.length) == ([0, 1, 2], 3 * ps)
    assert tree.match_prefix(toks("X", ps)).length == 0
    assert alloc.freed == []
    check_all(tree)


@pytest.mark.parametrize("ps", [2, 16])
def test_unaligned_input_caches_only_the_aligned_part(ps: int) -> None:
    tree, alloc = make(ps)
    tokens = toks("AB", ps) + [7] * (ps - 1)  # two full pages and a partial one
    pages = alloc.alloc(3)
    assert tree.insert(tokens, pages).already_cached == 0
    assert tree.stats().cached_pages == 2
    assert alloc.is_allocated(2)  # the partial page is still the caller's
    check_all(tree, held=1)
    alloc.free(pages[2:])
    # A query with a longer partial tail still matches only whole pages.
    m = tree.match_prefix(tokens + [7])
    assert (m.pages, m.length) == ([0, 1], 2 * ps)
    assert tree.stats().miss_tokens == ps  # the unaligned tail counts as a miss
    check_all(tree)


@pytest.mark.parametrize("ps", [2, 16])
def test_sequence_shorter_than_a_page_caches_nothing(ps: int) -> None:
    tree, alloc = make(ps)
    pages = alloc.alloc(1)
    assert tree.insert([1] * (ps - 1), pages) == InsertResult(0, 0)
    assert tree.insert([], []) == InsertResult(0, 0)
    assert tree.stats().cached_pages == 0
    assert alloc.is_allocated(pages[0])
    m = tree.match_prefix([1] * (ps - 1))
    assert (m.pages, m.length) == ([], 0)
    check_all(tree, held=1)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_one_page_sequence(ps: int) -> None:
    tree, alloc = make(ps)
    tree.insert(toks("A", ps), alloc.alloc(1))
    m = tree.match_prefix(toks("A", ps))
    assert (m.pages, m.length) == ([0], ps)
    assert tree.match_prefix(toks("A", ps)[:-1]).length == 0  # less than a page
    assert tree.evict(1) == 1
    assert alloc.freed == [[0]]
    check_all(tree)


def test_page_size_1_tokens_differ_mid_sequence() -> None:
    tree, alloc = make(1, 32)
    tree.insert(list(range(10)), alloc.alloc(10))
    query = list(range(7)) + [99, 8, 9]
    m = tree.match_prefix(query)
    assert (m.pages, m.length) == (list(range(7)), 7)
    assert tree.peek_prefix_length(list(range(10))) == 10
    check_all(tree)


def test_page_size_16_difference_in_the_last_token_of_a_page() -> None:
    tree, alloc = make(16)
    tokens = list(range(64))
    tree.insert(tokens, alloc.alloc(4))
    query = list(range(47)) + [1000] + list(range(48, 64))  # page 2 differs in its last token
    m = tree.match_prefix(query)
    assert (m.pages, m.length) == ([0, 1], 32)
    check_all(tree)


# ---- edge splits --------------------------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_ending_inside_an_edge_splits_it(ps: int) -> None:
    tree, alloc = make(ps)
    tree.insert(toks("ABCD", ps), alloc.alloc(4))
    full = tree.match_prefix(toks("ABCD", ps)).node
    m = tree.match_prefix(toks("ABXY", ps))
    assert (m.pages, m.length) == ([0, 1], 2 * ps)
    assert m.node.pages == [0, 1]
    assert list(m.node.children.values()) == [full]  # the old node kept the lower half
    assert full.pages == [2, 3] and full.parent is m.node
    tree.lock(m.node)
    assert tree.stats().locked_pages == 2
    assert tree.evict(10) == 2  # only the unlocked lower half can go
    assert sorted(alloc.freed[-1]) == [2, 3]
    assert not full.alive
    assert tree.match_prefix(toks("ABCD", ps)).pages == [0, 1]
    tree.unlock(m.node)
    check_all(tree)


def test_handle_survives_a_later_split_of_its_edge() -> None:
    tree, alloc = make(2)
    tree.insert(toks("ABCD", 2), alloc.alloc(4))
    deep = tree.match_prefix(toks("ABCD", 2))
    m = tree.match_prefix(toks("AB", 2))  # a strict prefix of the edge: splits it
    assert (m.pages, m.length) == ([0, 1], 4)
    assert deep.node.parent is m.node and deep.node.pages == [2, 3]
    tree.lock(deep.node)
    assert tree.stats().locked_pages == 4  # the whole path, both halves
    assert tree.evict(4) == 0
    tree.unlock(deep.node)
    assert tree.stats().locked_pages == 0
    check_all(tree)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_diverging_inside_an_edge_splits_it(ps: int) -> None:
    tree, alloc = make(ps)
    tree.insert(toks("ABCD", ps), alloc.alloc(4))
    fresh = alloc.alloc(4)  # [4, 5, 6, 7]
    r = tree.insert(toks("ABEF", ps), fresh)
    assert r == InsertResult(already_cached=2 * ps, freed_pages=2)
    assert alloc.freed == [[4, 5]]  # the caller's copies of A, B went back
    assert tree.match_prefix(toks("ABEF", ps)).pages == [0, 1, 6, 7]
    assert tree.match_prefix(toks("ABCD", ps)).pages == [0, 1, 2, 3]
    assert tree.stats().cached_pages == 6
    check_all(tree)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_of_a_strict_prefix_of_an_edge(ps: int) -> None:
    tree, alloc = make(ps)
    tree.insert(toks("ABCD", ps), alloc.alloc(4))
    r = tree.insert(toks("ABC", ps), alloc.alloc(3))  # [4, 5, 6], all duplicates
    assert r == InsertResult(already_cached=3 * ps, freed_pages=3)
    assert alloc.freed == [[4, 5, 6]]
    assert tree.match_prefix(toks("ABC", ps)).pages == [0, 1, 2]
    assert tree.num_nodes == 2  # the insert split A B C | D
    check_all(tree)


# ---- duplicate inserts and page ownership -------------------------------------------------


@pytest.mark.parametrize("ps", [2, 16])
def test_duplicate_insert_frees_the_callers_copies(ps: int) -> None:
    tree, alloc = make(ps)
    tree.insert(toks("ABC", ps), alloc.alloc(3))
    second = alloc.alloc(4)  # [3, 4, 5, 6]; the last page is a partial one
    r = tree.insert(toks("ABC", ps) + [1], second)
    assert r == InsertResult(already_cached=3 * ps, freed_pages=3)
    assert alloc.freed == [[3, 4, 5]]
    assert alloc.is_allocated(6)  # beyond the aligned part: still the caller's
    check_all(tree, held=1)


def test_insert_with_the_trees_own_pages_frees_nothing() -> None:
    """The request matched A B, locked it, computed C D and inserts the whole sequence."""
    tree, alloc = make(2)
    tree.insert(toks("AB", 2), alloc.alloc(2))
    m = tree.match_prefix(toks("ABCD", 2))
    tree.lock(m.node)
    own = m.pages + alloc.alloc(2)  # [0, 1, 2, 3]
    r = tree.insert(toks("ABCD", 2), own)
    assert r == InsertResult(already_cached=4, freed_pages=0)
    tree.unlock(m.node)
    assert alloc.freed == []
    assert tree.match_prefix(toks("ABCD", 2)).pages == [0, 1, 2, 3]
    check_all(tree)


def test_insert_with_mixed_own_and_duplicate_pages() -> None:
    """Own pages for A B (matched), duplicates for C D (another request inserted them first)."""
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))  # [0, 1]
    m = tree.match_prefix(toks("ABCDE", 1))
    tree.lock(m.node)
    mine = m.pages + alloc.alloc(3)  # [0, 1, 2, 3, 4]
    tree.insert(toks("ABCD", 1), alloc.alloc(4))  # another request: [5, 6, 7, 8], dupes 5, 6
    assert alloc.freed == [[5, 6]]
    r = tree.insert(toks("ABCDE", 1), mine)
    assert r == InsertResult(already_cached=4, freed_pages=2)
    assert alloc.freed[-1] == [2, 3]
    tree.unlock(m.node)
    assert tree.match_prefix(toks("ABCDE", 1)).pages == [0, 1, 7, 8, 4]
    check_all(tree)


def test_insert_and_lock_returns_the_canonical_pages_locked() -> None:
    tree, alloc = make(2)
    tree.insert(toks("AB", 2), alloc.alloc(2))  # [0, 1]
    running = alloc.alloc(5)  # [2, 3, 4, 5, 6]: A B C D (no cache hit) and a partial page
    m = tree.insert_and_lock(toks("ABCD", 2) + [9], running)
    assert (m.pages, m.length) == ([0, 1, 4, 5], 8)
    assert alloc.freed == [[2, 3]]
    assert tree.stats().locked_pages == 4
    assert tree.evict(4) == 0
    # The request's final insert passes the canonical pages back: nothing is freed.
    tail = alloc.alloc(1)  # [7]
    r = tree.insert(toks("ABCD", 2) + [9, 9, 9], m.pages + [6] + tail)
    assert r == InsertResult(already_cached=8, freed_pages=0)
    assert alloc.freed == [[2, 3]]
    tree.unlock(m.node)
    alloc.free(tail)
    assert tree.stats() == CacheStats(5, 5, 0, 0, 0)
    check_all(tree)


def test_insert_and_lock_of_less_than_a_page_returns_a_root() -> None:
    tree, alloc = make(4)
    m = tree.insert_and_lock([1, 2], [alloc.alloc(1)[0]])
    assert (m.pages, m.length) == ([], 0) and m.node.is_root
    tree.unlock(m.node)
    check_all(tree, held=1)


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([4, 5], "at least 3 pages"),  # too short
        ([4, 5, 9], "not allocated"),
        ([4, 5, 1], "another position"),  # page 1 is the tree's (page of B)
        ([4, 4, 5], "twice"),  # the duplicate of A is also passed as a new page
        ([4, 5, 5], "twice"),  # a new page repeated
        ([1, 4, 5], "another position"),  # the duplicate of A is the tree's page of B
        ([0, 5, 1], "another position"),  # A matches the tree's page, 1 is the tree's too
    ],
)
def test_bad_insert_raises_and_changes_nothing(pages: list[int], message: str) -> None:
    tree, alloc = make(1, 8)
    tree.insert(toks("AB", 1), alloc.alloc(2))
    alloc.alloc(4)  # 2..5 held by the caller
    before = tree.stats()
    with pytest.raises(ValueError, match=message):
        tree.insert(toks("AXY", 1), pages)
    assert tree.stats() == before
    assert tree.match_prefix(toks("AXY", 1)).length == 1
    assert alloc.freed == []
    check_all(tree, held=4)


@pytest.mark.parametrize("ps", [1, 4])  # at page size 4 the tokens are less than a page
@pytest.mark.parametrize("tokens", [[-1, 2], [2**32], [1.5], b"ab", "ab"])
def test_invalid_tokens_raise_value_error(tokens: object, ps: int) -> None:
    tree, alloc = make(ps)
    with pytest.raises(ValueError):
        tree.match_prefix(tokens)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tree.peek_prefix_length(tokens)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tree.insert(tokens, alloc.alloc(2))  # type: ignore[arg-type]
    assert tree.stats() == CacheStats(0, 0, 0, 0, 0)
    check_all(tree, held=2)


def test_tokens_may_be_any_int_sequence() -> None:
    tree, alloc = make(2)
    tree.insert(tuple(range(6)), tuple(alloc.alloc(3)))
    assert tree.match_prefix(range(6)).pages == [0, 1, 2]
    check_all(tree)


# ---- lock / unlock ------------------------------------------------------------------------


def test_locks_are_reference_counted_and_cover_the_path() -> None:
    tree, alloc = make(1)
    tree.insert(toks("ABC", 1), alloc.alloc(3))
    tree.insert(toks("ABD", 1), alloc.alloc(3))  # dupes freed; D -> page 5
    node = tree.match_prefix(toks("ABC", 1)).node
    tree.lock(node)
    tree.lock(node)
    assert tree.stats() == CacheStats(4, 1, 3, 3, 0)
    tree.unlock(node)
    assert tree.evict(4) == 1  # only D's page; A B C still locked once
    assert alloc.freed[-1] == [5]
    tree.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(node)
    assert tree.stats().locked_pages == 0
    check_all(tree)


def test_lock_of_an_evicted_node_is_an_error() -> None:
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))
    node = tree.match_prefix(toks("AB", 1)).node
    tree.evict(2)
    assert not node.alive
    with pytest.raises(ValueError, match="stale"):
        tree.lock(node)
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(node)


# ---- eviction order -----------------------------------------------------------------------


def test_eviction_is_lru_among_unlocked_leaves() -> None:
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))  # t1: pages 0 1
    tree.insert(toks("CD", 1), alloc.alloc(2))  # t2: pages 2 3
    tree.insert(toks("EF", 1), alloc.alloc(2))  # t3: pages 4 5
    tree.match_prefix(toks("AB", 1))  # A B is now the most recent
    evicted = []
    for _ in range(6):
        assert tree.evict(1) == 1
        evicted += alloc.freed[-1]
        check_all(tree)
    assert evicted == [3, 2, 5, 4, 1, 0]  # C D first (deepest page first), then E F, then A B
    assert tree.evict(1) == 0


def test_evict_frees_exactly_the_asked_number_splitting_a_leaf() -> None:
    tree, alloc = make(2)
    tree.insert(toks("ABCD", 2), alloc.alloc(4))
    full = tree.match_prefix(toks("ABCD", 2)).node
    assert tree.evict(3) == 3
    assert alloc.freed == [[1, 2, 3]]
    assert not full.alive
    m = tree.match_prefix(toks("ABCD", 2))
    assert (m.pages, m.length) == ([0], 2)
    check_all(tree)


def test_interior_node_becomes_evictable_after_its_children() -> None:
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))  # t1
    tree.insert(toks("ABC", 1), alloc.alloc(3))  # t2: dupes 2 3 freed, C -> page 4
    tree.insert(toks("XY", 1), alloc.alloc(2))  # t3: pages 2 3 (reused)
    assert tree.evict(1) == 1 and alloc.freed[-1] == [4]  # C is the LRU leaf
    assert tree.evict(2) == 2 and alloc.freed[-1] == [0, 1]  # then A B, older than X Y
    assert tree.match_prefix(toks("XY", 1)).pages == [2, 3]
    check_all(tree)


def test_locked_leaf_is_skipped_and_later_evictable() -> None:
    tree, alloc = make(1)
    tree.insert(toks("A", 1), alloc.alloc(1))  # t1: page 0
    tree.insert(toks("B", 1), alloc.alloc(1))  # t2: page 1
    node = tree.match_prefix(toks("A", 1)).node  # t3
    tree.match_prefix(toks("B", 1))  # t4
    tree.lock(node)
    assert tree.evict(1) == 1 and alloc.freed[-1] == [1]
    assert tree.evict(1) == 0
    tree.unlock(node)
    assert tree.evict(1) == 1 and alloc.freed[-1] == [0]
    check_all(tree)


def test_evict_negative_is_an_error() -> None:
    tree, _ = make(1)
    with pytest.raises(ValueError):
        tree.evict(-1)


def test_flush_evicts_everything_unlocked() -> None:
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))
    tree.insert(toks("CD", 1), alloc.alloc(2))
    node = tree.match_prefix(toks("C", 1)).node
    tree.lock(node)
    assert tree.flush() == 3
    assert tree.stats() == CacheStats(1, 0, 1, 1, 0)
    tree.unlock(node)
    assert tree.flush() == 1
    assert alloc.num_free == alloc.total
    check_all(tree)


def test_heap_stays_bounded_under_lock_unlock_cycles() -> None:
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))
    node = tree.match_prefix(toks("AB", 1)).node
    for _ in range(1000):
        tree.lock(node)
        tree.unlock(node)
    assert len(tree._heap) <= 2 * 1 + 64 + 1
    check_all(tree)


# ---- namespaces and stats -----------------------------------------------------------------


def test_namespaces_never_share_nodes() -> None:
    tree, alloc = make(1)
    tree.insert(toks("AB", 1), alloc.alloc(2))  # default: 0 1
    r = tree.insert(toks("AB", 1), alloc.alloc(2), namespace="tenant-a")  # 2 3
    assert r.already_cached == 0 and alloc.freed == []
    assert tree.match_prefix(toks("AB", 1)).pages == [0, 1]
    assert tree.match_prefix(toks("AB", 1), namespace="").pages == [0, 1]  # "" is the default
    assert tree.match_prefix(toks("AB", 1), namespace="tenant-a").pages == [2, 3]
    assert tree.match_prefix(toks("AB", 1), namespace="tenant-b").length == 0
    assert tree.peek_prefix_length(toks("AB", 1), namespace="tenant-b") == 0
    assert tree.stats().cached_pages == 4
    tree.flush()
    assert set(tree._roots) == {None}  # empty tenant subtrees are dropped
    check_all(tree)


def test_namespace_must_be_a_string() -> None:
    tree, _ = make(1)
    with pytest.raises(ValueError, match="namespace"):
        tree.match_prefix([1], namespace=3)  # type: ignore[arg-type]


def test_hit_and_miss_counters() -> None:
    tree, alloc = make(2)
    tree.insert(toks("AB", 2), alloc.alloc(2))
    tree.match_prefix(toks("ABC", 2) + [1])  # 4 hit, 3 miss
    tree.match_prefix(toks("X", 2))  # 2 miss
    tree.peek_prefix_length(toks("AB", 2))  # not counted
    s = tree.stats()
    assert (s.hit_tokens, s.miss_tokens) == (4, 5)


def test_peek_changes_nothing() -> None:
    tree, alloc = make(1)
    tree.insert(toks("ABCD", 1), alloc.alloc(4))  # t1
    tree.insert(toks("XY", 1), alloc.alloc(2))  # t2
    assert tree.peek_prefix_length(toks("ABZ", 1)) == 2
    assert tree.num_nodes == 2  # no split
    assert tree.evict(1) == 1 and alloc.freed[-1] == [3]  # A B C D is still the LRU leaf
    check_all(tree)


def test_deep_chain_at_page_size_1() -> None:
    """2,000 one-token nodes on one path: no recursion limits, eviction walks up the chain."""
    tree, alloc = make(1, 2000)
    tokens = list(range(2000))
    for end in range(1, 2001):
        m = tree.match_prefix(tokens[:end])
        tree.lock(m.node)
        r = tree.insert(tokens[:end], m.pages + alloc.alloc(end - m.length))
        assert r == InsertResult(already_cached=end - 1, freed_pages=0)
        tree.unlock(m.node)
    assert tree.num_nodes == 2000
    m = tree.match_prefix(tokens)
    assert (m.pages, m.length) == (list(range(2000)), 2000)
    check_all(tree)
    assert tree.evict(1500) == 1500
    assert sorted(alloc.freed[-1]) == list(range(500, 2000))
    check_all(tree)


# ---- NoCache ------------------------------------------------------------------------------


def test_no_cache_matches_nothing_and_frees_every_aligned_page() -> None:
    alloc = RecordingAllocator(8)
    cache = NoCache(2, alloc)
    pages = alloc.alloc(3)
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.pages, m.length) == ([], 0)
    cache.lock(m.node)
    r = cache.insert([1, 2, 3, 4, 5], pages)
    assert r == InsertResult(already_cached=0, freed_pages=2)
    assert alloc.freed == [[0, 1]] and alloc.is_allocated(2)
    cache.unlock(m.node)
    assert cache.evict(10) == 0 and cache.flush() == 0
    assert cache.stats() == CacheStats(0, 0, 0, 0, 0)
    assert cache.peek_prefix_length([1, 2]) == 0
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [2])
    cache.check()


def test_no_cache_insert_and_lock_leaves_pages_with_the_caller() -> None:
    alloc = PageAllocator(8)
    cache = NoCache(2, alloc)
    pages = alloc.alloc(2)
    m = cache.insert_and_lock([1, 2, 3, 4], pages)
    assert (m.pages, m.length) == ([0, 1], 4)
    assert alloc.num_used == 2
    cache.insert([1, 2, 3, 4], m.pages)
    cache.unlock(m.node)
    assert alloc.num_used == 0


def test_no_cache_rejects_foreign_nodes() -> None:
    tree, alloc = make(1)
    tree.insert([1], alloc.alloc(1))
    node = tree.match_prefix([1]).node
    cache = NoCache(1, alloc)
    with pytest.raises(ValueError):
        cache.lock(node)


@pytest.mark.parametrize("ps", [0, -1, 1.5])
def test_invalid_page_size(ps: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(ps, PageAllocator(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_size"):
        NoCache(ps, PageAllocator(1))  # type: ignore[arg-type]
