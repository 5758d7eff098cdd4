"""The scheduler's side of the disk tier (``--kv-disk-dir``): what to write, read, load, delete.

The radix tree holds what is in the KV pool; `DiskIndex` (cache/disk_index.py) what is on
disk. This class joins them and collects the worker's orders for the next step (`DiskOps`):

- eviction: the tree calls `spill` with each leaf it is about to free; pages the disk does not
  hold yet are written back (the worker copies them out before the step reuses their ids);
- admission: after the memory match, the pages that follow on disk are read ahead into the
  worker's memory (`prefetch`) while the request waits; once the worker reports them ready,
  `KVManager.admit` loads them into fresh pool pages, puts them in the tree, and counts them as
  cached (tier "disk"). A page that fails its checks is dropped and computed instead.

A request's page keys (a SHA-256 chain over its tokens) are computed once and kept on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.base import TreeNode
from radixserve.cache.disk_index import DiskIndex, chain_keys, namespace_key
from radixserve.cache.radix_tree import RadixTree, pack_tokens
from radixserve.protocol import DiskOps, DiskReport
from radixserve.scheduler.request import Request

PREFETCH_AHEAD = 16  # waiting requests, from the queue's head, whose pages are read ahead


class DiskTier:
    def __init__(self, tree: RadixTree, model_key: bytes, capacity_pages: int, known: Sequence[bytes],
                 page_bytes: int, max_staged_pages: int) -> None:
        self.tree = tree
        self.page_size = tree.page_size
        self.index = DiskIndex(capacity_pages, known)
        self.page_bytes = page_bytes  # one page on disk, header included
        self.max_staged = max_staged_pages
        self._model_key = model_key
        self._namespace_keys: dict[str | None, bytes] = {}
        self.ops = DiskOps()
        self.prefetching: set[bytes] = set()  # reads asked for, not reported yet
        self.staged: set[bytes] = set()  # read and checked by the worker, not loaded yet
        self.report = DiskReport()  # the worker's last: its lifetime counters
        self.ops.delete += self.index.over_budget()
        tree.namespace_key = self.namespace_key
        tree.spill = self.spill

    def namespace_key(self, namespace: str | None) -> bytes:
        key = self._namespace_keys.get(namespace)
        if key is None:
            key = self._namespace_keys[namespace] = namespace_key(self._model_key, namespace)
        return key

    def keys_for(self, tokens: list[int], namespace: str | None) -> list[bytes]:
        """Keys of the whole pages of `tokens` in `namespace` (a pin's prefix)."""
        n = len(tokens) - len(tokens) % self.page_size
        return chain_keys(self.namespace_key(namespace), pack_tokens(tokens, n), self.page_size * 4)

    def request_keys(self, req: Request) -> list[bytes]:
        """Keys of the request's whole pages that may come from a cache (`match_limit`)."""
        n_pages = req.match_limit // self.page_size
        keys = req.page_keys
        if len(keys) < n_pages:
            previous = keys[-1] if keys else self.namespace_key(req.namespace)
            start = len(keys) * self.page_size
            packed = pack_tokens(req.fill_ids[start : n_pages * self.page_size], (n_pages * self.page_size) - start)
            keys += chain_keys(previous, packed, self.page_size * 4)
        return keys[:n_pages]

    # ------------------------------------------------------------------ eviction

    def spill(self, node: TreeNode) -> None:
        """A leaf's pages are about to be freed: write back the ones the disk lacks."""
        keys = self.tree.page_keys(node)
        for page, key in zip(node.pages, keys, strict=True):
            if key in self.index:
                self.index.touch([key])
                continue
            accepted, evicted = self.index.add(key)
            self.ops.delete += evicted
            if accepted:
                self.ops.store.append((page, key))

    # ------------------------------------------------------------------ admission

    def run(self, req: Request, cached: int) -> tuple[list[bytes], bool]:
        """The pages on disk that follow the request's `cached` tokens, and whether it must wait
        for them (reads under way, or asked for now): `KVManager.admit` loads the run once the
        worker holds it all."""
        run = self.index.run_from(self.request_keys(req), cached // self.page_size)
        missing = [key for key in run if key not in self.staged and key not in self.prefetching]
        if missing:
            self._prefetch(missing)
        return run, any(key in self.prefetching for key in run)

    def plan(self, waiting: list[Request]) -> None:
        """Read ahead for the requests at the queue's head; free what nobody waits for."""
        if not waiting:
            if self.staged:
                self.ops.unstage += self.staged
                self.staged = set()
            return
        for req in waiting[:PREFETCH_AHEAD]:
            if req.disk_planned:
                continue
            cached = self.tree.peek_prefix_length(req.fill_ids[: req.match_limit], req.namespace)
            run = self.index.run_from(self.request_keys(req), cached // self.page_size)
            missing = [key for key in run if key not in self.staged and key not in self.prefetching]
            if len(missing) + len(self.staged) + len(self.prefetching) > self.max_staged:
                break
            self._prefetch(missing)
            req.disk_planned = True

    def _prefetch(self, keys: list[bytes]) -> None:
        self.ops.prefetch += keys
        self.prefetching.update(keys)

    def take_loaded(self, pages: list[int], run: list[bytes]) -> None:
        """`run` goes into `pages` this step (KVManager.admit)."""
        self.ops.load += zip(pages, run, strict=True)
        self.staged.difference_update(run)
        self.index.touch(run)

    # ------------------------------------------------------------------ the worker's side

    def take_ops(self) -> DiskOps | None:
        ops = self.ops
        if not (ops.store or ops.load or ops.prefetch or ops.unstage or ops.delete):
            return None
        self.ops = DiskOps()
        return ops

    def absorb(self, report: DiskReport) -> None:
        for key in report.ready:
            if key in self.prefetching:
                self.prefetching.discard(key)
                self.staged.add(key)
            else:  # asked for twice, or no longer wanted: the worker may free it
                self.ops.unstage.append(key)
        for key in report.failed:
            self.prefetching.discard(key)
            self.index.remove(key)
        for key in report.lost:
            self.index.remove(key)
        self.report = report

    def flush(self) -> None:
        """``/flush_cache``: the disk's pages go too, but for the pinned."""
        self.ops.delete += self.index.drop_unpinned()

    @property
    def waiting_on_reads(self) -> bool:
        return bool(self.prefetching)

    @property
    def bytes_used(self) -> int:
        return len(self.index) * self.page_bytes
