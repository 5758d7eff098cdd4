"""The disk tier's index: which KV pages the disk holds, by page key, in LRU order, with pins.

A page's key is SGLang HiCache's scheme: SHA-256 over the previous page's key and the page's
token ids (packed 4-byte ints, as the radix tree stores them), so a key names a page *and every
token before it*. The chain starts at a namespace key, SHA-256 over the model key (content hash
of the weights, dtype, page size and KV layout: the worker's `WorkerReady.kv_model_key`) and the
request's cache namespace (tenant and `cache_salt`). Nothing can be read back under another
model, layout or tenant: its keys differ from the first page on.

    namespace key  N = sha256("radixserve-kv" | model key | namespace)
    page 0 key     K0 = sha256(N  | tokens[0:ps])
    page 1 key     K1 = sha256(K0 | tokens[ps:2ps])      ...

The scheduler owns this index (what is on disk, what goes first); the worker owns the files and
only ever does what the scheduler's `ForwardBatch` says (write, read ahead, load, delete). Pure
Python, no torch, like the rest of this package.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

_NAMESPACE_TAG = b"radixserve-kv\x00"


def namespace_key(model_key: bytes, namespace: str | None) -> bytes:
    """The chain's start for one cache namespace (``None`` and ``""`` are the shared one)."""
    salt = (namespace or "").encode("utf-8", "surrogatepass")
    return hashlib.sha256(_NAMESPACE_TAG + model_key + salt).digest()


def chain_keys(previous: bytes, packed: bytes, page_bytes: int) -> list[bytes]:
    """Keys of the whole pages of ``packed`` (token ids, 4 bytes each), following ``previous``."""
    keys: list[bytes] = []
    sha256 = hashlib.sha256
    for start in range(0, len(packed) - len(packed) % page_bytes, page_bytes):
        previous = sha256(previous + packed[start : start + page_bytes]).digest()
        keys.append(previous)
    return keys


class DiskIndex:
    """The pages on disk, least recently used first, within a budget of ``capacity`` pages.

    Pinned pages (a pin with ``tier: "disk"``) are never chosen for eviction; `add` refuses a
    page rather than go over budget when every page on disk is pinned.
    """

    def __init__(self, capacity: int, known: Iterable[bytes] = ()) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 pages, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict((key, None) for key in known)
        self._pins: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def pinned(self) -> int:
        """Pages held on disk by pins."""
        return len(self._pins)

    def over_budget(self) -> list[bytes]:
        """Evict down to capacity (after start-up found more than the budget); keys to delete."""
        return self._evict(len(self._lru) - self.capacity)

    def run_from(self, keys: list[bytes], start: int) -> list[bytes]:
        """The keys ``keys[start:]`` the disk holds without a gap: a prefix is only usable whole."""
        run: list[bytes] = []
        for key in keys[start:]:
            if key not in self._lru:
                break
            run.append(key)
        return run

    def touch(self, keys: list[bytes]) -> None:
        """Mark a prefix's pages used, deepest first: its first page ends most recent, so
        eviction takes a prefix from its end and never leaves pages that no walk can reach."""
        lru = self._lru
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)

    def add(self, key: bytes) -> tuple[bool, list[bytes]]:
        """Record a page being written; returns (accepted, keys evicted to make room).

        A page already on disk is only touched. Not accepted when the budget is all pins.
        """
        if key in self._lru:
            self._lru.move_to_end(key)
            return True, []
        if self.capacity == 0:
            return False, []
        evicted = self._evict(len(self._lru) + 1 - self.capacity)
        if len(self._lru) >= self.capacity:
            return False, evicted
        self._lru[key] = None
        return True, evicted

    def remove(self, key: bytes) -> None:
        """Forget a page (its write failed, or its file turned out unreadable)."""
        self._lru.pop(key, None)
        self._pins.pop(key, None)

    def pin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            count = self._pins.get(key, 0) - 1
            if count > 0:
                self._pins[key] = count
            else:
                self._pins.pop(key, None)

    def drop_unpinned(self) -> list[bytes]:
        """Everything but the pins (``/flush_cache``); keys to delete."""
        dropped = [key for key in self._lru if key not in self._pins]
        for key in dropped:
            del self._lru[key]
        return dropped

    def _evict(self, n: int) -> list[bytes]:
        evicted: list[bytes] = []
        if n <= 0:
            return evicted
        for key in self._lru:
            if key not in self._pins:
                evicted.append(key)
                if len(evicted) == n:
                    break
        for key in evicted:
            del self._lru[key]
        return evicted
