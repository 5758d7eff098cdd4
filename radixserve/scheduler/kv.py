"""The scheduler's bookkeeping of KV memory: free pages, the prefix cache, page-table rows.

Accounting invariant, checked by `check()` after every step in debug mode:

    allocator free + pages held by the tree + request-owned pages == total
"""

from __future__ import annotations

from radixserve.cache.allocator import OutOfPages, PageAllocator
from radixserve.cache.base import NoCache, PrefixCache
from radixserve.cache.radix_tree import RadixTree
from radixserve.scheduler.disk_tier import DiskTier
from radixserve.scheduler.request import Request
from radixserve.scheduler.segments import plan_blend


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVManager:
    """Hands pages and rows to requests, takes them back, and moves finished work into the cache."""

    def __init__(self, total_pages: int, page_size: int, max_rows: int, enable_cache: bool) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(total_pages)
        self.caching = enable_cache
        cache_cls = RadixTree if enable_cache else NoCache
        self.cache: PrefixCache = cache_cls(page_size, self.allocator)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.disk: DiskTier | None = None  # attach_disk, with --kv-disk-dir
        self.segment_group = 0  # tokens per recompute group of a blend; 0: segments are plain prompt
        self.assigned: list[tuple[int, list[int]]] = []  # deltas for the next ForwardBatch
        self.appended: list[tuple[int, list[int]]] = []
        self.released: list[int] = []

    @property
    def total_pages(self) -> int:
        return self.allocator.total

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now: free ones plus unlocked cached ones."""
        return self.allocator.num_free + self.cache.evictable_pages

    @property
    def has_free_row(self) -> bool:
        return bool(self._free_rows)

    def take_deltas(self) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]], list[int]]:
        out = (self.assigned, self.appended, self.released)
        self.assigned, self.appended, self.released = [], [], []
        return out

    def alloc(self, n: int) -> list[int]:
        """n pages, evicting least recently used cached prefixes if needed. Raises OutOfPages."""
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def attach_disk(self, model_key: bytes, capacity_pages: int, known: list[bytes], page_bytes: int) -> None:
        """Put the disk tier under the tree (scheduler/disk_tier.py)."""
        if not isinstance(self.cache, RadixTree):
            raise ValueError("the disk tier needs the prefix cache")
        self.disk = DiskTier(self.cache, model_key, capacity_pages, known, page_bytes, self.total_pages)

    def disk_run(self, req: Request, cached: int) -> tuple[int, bool]:
        """Pages on disk that follow the request's `cached` tokens, and whether they are still
        being read (the request waits for them: `admit` loads them once the worker has them)."""
        if self.disk is None:
            return 0, False
        run, reading = self.disk.run(req, cached)
        return len(run), reading

    def admit(self, req: Request) -> tuple[int, int]:
        """Match and lock the request's cached prefix and give it a row: the pages in memory,
        then those that follow on disk, loaded into fresh pages (`disk_run` said they are all
        read). Returns the matched tokens, from memory and from disk."""
        match = self.cache.match_prefix(req.fill_ids[: req.match_limit], req.namespace)
        self.cache.lock(match.node)
        from_disk = 0
        if self.disk is not None:
            run, reading = self.disk.run(req, match.length)
            if run and not reading:
                pages = self.alloc(len(run))
                self.disk.take_loaded(pages, run)
                end = match.length + len(run) * self.page_size
                loaded = self.cache.insert_and_lock(req.fill_ids[:end], match.pages + pages, req.namespace)
                self.cache.unlock(match.node)
                match, from_disk = loaded, len(run) * self.page_size
        req.node, req.pages, req.tree_len, req.computed_len = match.node, list(match.pages), match.length, match.length
        if req.segments and self.segment_group:
            req.blend = plan_blend(
                req.segments, req.input_ids, match.length, req.match_limit, req.recompute_ratio, self.cache,
                req.namespace, self.page_size, self.segment_group,
            )
        req.row = self._free_rows.pop()
        self.assigned.append((req.row, list(req.pages)))
        return match.length - from_disk, from_disk

    def grow(self, req: Request, new_len: int) -> None:
        """Make the request's pages cover `new_len` tokens. Raises OutOfPages, changing nothing."""
        need = pages_for(new_len, self.page_size) - len(req.pages)
        if need > 0:
            pages = self.alloc(need)
            req.pages.extend(pages)
            self.appended.append((req.row, pages))

    def cache_progress(self, req: Request) -> None:
        """Publish the request's computed whole pages to the tree so others can hit them now
        (of a blend, only the exact prefix before its first reused token)."""
        computed = min(req.computed_len, req.publish_limit)
        aligned = computed - computed % self.page_size
        if not self.caching or aligned <= req.tree_len:
            return
        match = self.cache.insert_and_lock(req.fill_ids[:aligned], req.pages, req.namespace)
        n = len(match.pages)
        if match.pages != req.pages[:n]:
            req.pages[:n] = match.pages
            self.assigned.append((req.row, list(req.pages)))
        self.cache.unlock(req.node)
        req.node, req.tree_len = match.node, match.length

    def release_segments(self, req: Request) -> None:
        """Unlock the segment-cache pages a blend copies from (once its prompt is computed)."""
        if req.blend is not None:
            for node in req.blend.nodes:
                self.cache.unlock(node)
            req.blend.nodes = []

    def release(self, req: Request) -> None:
        """The request leaves the running set: its computed prefix goes to the cache (of a
        blend, the exact prefix only), the rest is freed."""
        tokens = req.fill_ids[: min(req.computed_len, req.publish_limit)]
        self.cache.insert(tokens, req.pages, req.namespace)
        self.allocator.free(req.pages[len(tokens) // self.page_size :])
        self.release_segments(req)
        self.cache.unlock(req.node)
        self._free_rows.append(req.row)
        self.released.append(req.row)
        req.reset_kv()

    def running_pages(self) -> int:
        """Pages running requests hold: their own, and the cached ones they lock (a chunked
        prefill publishes its pages to the tree as it goes, but they are no less in use)."""
        return self.allocator.num_used - self.cache.stats().evictable_pages

    def flush(self) -> int:
        """``/flush_cache``: drop every unlocked prefix, in memory and on disk (pins stay)."""
        if self.disk is not None:
            self.disk.flush()
        return self.cache.flush()

    def check(self, running: list[Request]) -> None:
        """Raise RuntimeError unless free + tree + request-owned pages == total."""
        self.allocator.check()
        self.cache.check()
        owned = sum(len(r.pages) - r.tree_len // self.page_size for r in running)
        cached = self.cache.stats().cached_pages
        if self.allocator.num_free + cached + owned != self.allocator.total:
            raise RuntimeError(
                f"page accounting broken: free {self.allocator.num_free} + cached {cached} "
                f"+ request-owned {owned} != total {self.allocator.total}"
            )


__all__ = ["KVManager", "OutOfPages", "pages_for"]
