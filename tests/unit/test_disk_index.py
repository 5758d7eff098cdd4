"""The disk tier's parts without a server: the index's LRU and pins, the page-key chain, the
radix tree's write-back hook, and the worker's page files (round trip, corruption, torn files,
another model's files, one server per directory)."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.cache.allocator import PageAllocator
from radixserve.cache.disk_index import DiskIndex, chain_keys, namespace_key
from radixserve.cache.radix_tree import RadixTree, pack_tokens
from radixserve.protocol import DiskOps
from radixserve.worker.kv_disk import DiskStore

MODEL = hashlib.sha256(b"model").digest()


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


# ---------------------------------------------------------------------------------- the index


def test_least_recently_used_pages_go_first_and_a_prefix_from_its_end():
    index = DiskIndex(capacity=4)
    a, b, c, d, e = keys(5)
    for key in (a, b, c, d):
        assert index.add(key) == (True, [])
    index.touch([a, b])  # a prefix used: b first, then a, so a is the most recent
    accepted, evicted = index.add(e)
    assert accepted and evicted == [c]
    accepted, evicted = index.add(keys(6)[5])
    assert evicted == [d]
    assert index.run_from([a, b, c], 0) == [a, b]  # c is gone: the run stops there
    assert index.run_from([a, b, c], 1) == [b]


def test_pins_are_never_evicted_and_a_budget_of_pins_refuses_new_pages():
    index = DiskIndex(capacity=2)
    a, b, c = keys(3)
    index.add(a)
    index.add(b)
    index.pin([a, b])
    assert index.add(c) == (False, [])
    assert a in index and b in index and c not in index
    index.unpin([b])
    assert index.add(c) == (True, [b])
    assert index.drop_unpinned() == [c] and len(index) == 1 and index.pinned == 1


def test_a_start_over_budget_is_cut_to_it_oldest_first():
    index = DiskIndex(capacity=2, known=keys(5))
    assert index.over_budget() == keys(3)
    assert len(index) == 2


def test_a_page_key_names_every_token_before_it_its_namespace_and_its_model():
    page_bytes = 4 * 4
    tokens = list(range(12))
    base = chain_keys(namespace_key(MODEL, None), pack_tokens(tokens, 12), page_bytes)
    assert len(base) == 3
    changed = chain_keys(namespace_key(MODEL, None), pack_tokens([99, *tokens[1:]], 12), page_bytes)
    assert all(x != y for x, y in zip(base, changed, strict=True))  # one token changes every later key
    assert namespace_key(MODEL, None) == namespace_key(MODEL, "")
    assert chain_keys(namespace_key(MODEL, "tenant-b"), pack_tokens(tokens, 12), page_bytes)[0] != base[0]
    other = hashlib.sha256(b"another model").digest()
    assert chain_keys(namespace_key(other, None), pack_tokens(tokens, 12), page_bytes)[0] != base[0]


# ---------------------------------------------------------------------------------- the tree's hook


def test_eviction_hands_each_leaf_to_spill_with_keys_that_follow_its_whole_prefix():
    page_size = 2
    tree = RadixTree(page_size, PageAllocator(16))
    tree.namespace_key = lambda ns: namespace_key(MODEL, ns)
    spilled: list[tuple[list[int], list[bytes]]] = []
    tree.spill = lambda node: spilled.append((list(node.pages), list(tree.page_keys(node))))
    tokens = list(range(8))
    tree.insert(tokens, tree.allocator.alloc(4))
    tree.insert([0, 1, 2, 3, 50, 51], tree.allocator.alloc(3))  # splits the edge; 2 pages were cached
    expected = chain_keys(namespace_key(MODEL, None), pack_tokens(tokens, 8), page_size * 4)
    branch = chain_keys(namespace_key(MODEL, None), pack_tokens([0, 1, 2, 3, 50, 51], 6), page_size * 4)
    assert branch[:2] == expected[:2]  # the shared pages have one key
    assert tree.evict(5) == 5
    got = [key for _, ks in spilled for key in ks]
    assert sorted(got) == sorted(set(expected) | set(branch))
    assert sum(len(p) for p, _ in spilled) == 5
    tree.check()


def test_flush_drops_without_writing_back():
    tree = RadixTree(2, PageAllocator(8))
    tree.namespace_key = lambda ns: namespace_key(MODEL, ns)
    spilled = []
    tree.spill = spilled.append
    tree.insert(list(range(6)), tree.allocator.alloc(3))
    assert tree.flush() == 3 and spilled == []


# ---------------------------------------------------------------------------------- the worker's files


def _pool(page_size: int = 2, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(num_layers=2, num_pages=8, page_size=page_size, num_kv_heads=2, head_dim=4, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return pool


def _wait_report(store: DiskStore, want: int, timeout: float = 10.0):
    ready, failed, lost = [], [], []
    deadline = time.monotonic() + timeout
    while len(ready) + len(failed) + len(lost) < want and time.monotonic() < deadline:
        report = store.report()
        ready += report.ready
        failed += report.failed
        lost += report.lost
        time.sleep(0.01)
    return ready, failed, lost


def _page(pool: KVPool, page: int) -> torch.Tensor:
    return torch.stack([torch.stack((k[page], v[page])) for k, v in zip(pool.k, pool.v, strict=True)])


def _written(store: DiskStore, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(store.dir.glob("*.kv"))) < n or store._writing:
        assert time.monotonic() < deadline, "the writer did not finish"
        time.sleep(0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_written_read_back_and_loaded_are_bit_identical(tmp_path, dtype):
    pool = _pool(dtype=dtype)
    store = DiskStore(tmp_path, pool, MODEL)
    a, b = keys(2)
    before = [_page(pool, 3).clone(), _page(pool, 5).clone()]
    store.apply(DiskOps(store=[(3, a), (5, b)]))
    _written(store, 2)
    for t in (*pool.k, *pool.v):
        t.zero_()  # the pages' ids are reused by other data
    store.apply(DiskOps(prefetch=[a, b]))
    ready, failed, _ = _wait_report(store, 2)
    assert sorted(ready) == sorted([a, b]) and failed == []
    store.apply(DiskOps(load=[(6, a), (1, b)]))
    assert torch.equal(_page(pool, 6), before[0]) and torch.equal(_page(pool, 1), before[1])
    report = store.report()
    assert report.stored_bytes == 2 * store.payload_bytes == report.loaded_bytes
    assert oct(tmp_path.stat().st_mode & 0o777) == "0o700" and oct(store.dir.stat().st_mode & 0o777) == "0o700"


def test_a_page_still_being_written_is_read_from_its_copy(tmp_path):
    pool = _pool()
    store = DiskStore(tmp_path, pool, MODEL)
    (a,) = keys(1)
    want = _page(pool, 2).clone()
    store.apply(DiskOps(store=[(2, a)], prefetch=[a]))  # the read is queued with the write
    ready, _, _ = _wait_report(store, 1)
    assert ready == [a]
    store.apply(DiskOps(load=[(7, a)]))
    assert torch.equal(_page(pool, 7), want)


def test_a_corrupt_file_is_dropped_with_a_warning_and_never_loaded(tmp_path, caplog):
    pool = _pool()
    store = DiskStore(tmp_path, pool, MODEL)
    a, b = keys(2)
    store.apply(DiskOps(store=[(1, a), (2, b)]))
    _written(store, 2)
    path = store.dir / (a.hex() + ".kv")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # one payload byte
    path.write_bytes(bytes(raw))
    store.apply(DiskOps(prefetch=[a, b]))
    ready, failed, _ = _wait_report(store, 2)
    assert ready == [b] and failed == [a]
    assert not path.exists() and "checksum" in caplog.text
    assert store.report().corrupt_pages == 1


def test_start_up_finds_whole_files_and_deletes_torn_and_truncated_ones(tmp_path):
    pool = _pool()
    store = DiskStore(tmp_path, pool, MODEL)
    a, b, c = keys(3)
    store.apply(DiskOps(store=[(1, a), (2, b), (3, c)]))
    _written(store, 3)
    (store.dir / (b.hex() + ".kv.1.tmp")).write_bytes(b"half a page")  # a write cut short
    truncated = store.dir / (c.hex() + ".kv")
    truncated.write_bytes(truncated.read_bytes()[:100])
    (store.dir / ((b"\xee" * 32).hex() + ".kv")).write_bytes(b"RSKV" + bytes(200))  # a bad header
    found = store.scan()
    assert found == [a, b]
    assert not truncated.exists() and not list(store.dir.glob("*.tmp"))


def test_another_model_or_layout_sees_none_of_the_pages_and_one_server_holds_a_directory(tmp_path):
    pool = _pool()
    store = DiskStore(tmp_path, pool, MODEL)
    store.apply(DiskOps(store=[(1, keys(1)[0])]))
    _written(store, 1)
    with pytest.raises(RuntimeError, match="in use by another"):
        DiskStore(tmp_path, pool, MODEL)
    store._lock_file.close()  # as if the first server exited
    other = DiskStore(tmp_path, pool, hashlib.sha256(b"other").digest())
    assert other.scan() == []
