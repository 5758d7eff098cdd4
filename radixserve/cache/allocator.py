"""Page allocator: the free list of KV page ids and their exact accounting.

The scheduler owns page *bookkeeping*; the worker owns the tensors the ids index. Every page id
is, at any moment, in exactly one of three places: this allocator's free list, a running request,
or the radix tree. The allocator only knows "free" versus "allocated"; it does not track who holds
an allocated page, so `free + held by requests + held by the tree == total` is checked by callers
(the tree's `check()` verifies its own pages are allocated).

Order is deterministic so tests can assert exact ids: a fresh allocator hands out the lowest ids
first (0, 1, 2, ...), and freed pages are reused first (LIFO), in the order they were freed.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Raised by `PageAllocator.alloc` when fewer pages are free than asked for.

    Nothing was allocated when this is raised (allocation is all or nothing); the caller may evict
    from the cache, retract a request, or wait.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} pages but only {available} are free")
        self.requested = requested
        self.available = available


class PageAllocator:
    """A free list of page ids ``0 .. num_pages-1`` with all-or-nothing allocation.

    Contracts:
    - `alloc(n)` returns exactly ``n`` distinct page ids or raises `OutOfPages` having taken none.
    - `free(pages)` raises `ValueError` (and frees nothing) if any id is out of range, not
      currently allocated, or listed twice: a double free is a bug, never a silent no-op.
    - Costs are O(n) in the number of pages passed, with the loops in C (list/set operations).
    """

    __slots__ = ("_total", "_free", "_allocated")

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        self._total = num_pages
        # A stack: the top (end of the list) is handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def total(self) -> int:
        """Number of pages managed (free + allocated)."""
        return self._total

    @property
    def num_free(self) -> int:
        """Pages that `alloc` can hand out right now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages allocated and not yet freed (held by requests or by the cache)."""
        return len(self._allocated)

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is currently allocated (not on the free list)."""
        return page in self._allocated

    def all_allocated(self, pages: Iterable[int]) -> bool:
        """Whether every page in ``pages`` is currently allocated (one C-level set operation)."""
        return self._allocated.issuperset(pages)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages off the free list; all or nothing.

        Raises `OutOfPages` if fewer than ``n`` are free, `ValueError` if ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n == 0:
            return []
        free = self._free
        if n > len(free):
            raise OutOfPages(n, len(free))
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        self._allocated.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the free list; validates all of them before freeing any.

        Raises `ValueError` naming the first offending id if one is out of range, not allocated
        (a double free or a page never handed out), or repeated in ``pages``.
        """
        pages = list(pages)
        if not pages:
            return
        allocated = self._allocated
        if not allocated.issuperset(pages) or len(set(pages)) != len(pages):
            self._raise_bad_free(pages)
        allocated.difference_update(pages)
        # Reversed so that the next alloc(len(pages)) returns them in this order.
        self._free.extend(reversed(pages))

    def _raise_bad_free(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for page in pages:
            if not isinstance(page, int) or not 0 <= page < self._total:
                raise ValueError(f"page {page!r} is out of range [0, {self._total})")
            if page in seen:
                raise ValueError(f"page {page} is listed twice in one free() call")
            if page not in self._allocated:
                raise ValueError(f"page {page} is not allocated (double free?)")
            seen.add(page)
        raise AssertionError("unreachable: free() validation failed without a bad page")

    def check(self) -> None:
        """Verify the accounting: no page free twice, none both free and allocated, none lost.

        Raises `RuntimeError` describing the first violation. O(total).
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise RuntimeError("a page is on the free list twice")
        if free_set & self._allocated:
            raise RuntimeError("a page is both free and allocated")
        if len(free_set) + len(self._allocated) != self._total:
            lost = self._total - len(free_set) - len(self._allocated)
            raise RuntimeError(f"{lost} pages are neither free nor allocated (lost)")
        if any(not 0 <= p < self._total for p in free_set | self._allocated):
            raise RuntimeError("a page id is out of range")

    def __repr__(self) -> str:
        return f"PageAllocator(total={self._total}, free={self.num_free}, used={self.num_used})"
