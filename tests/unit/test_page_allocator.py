from __future__ import annotations

import pytest

from radixserve.cache import OutOfPages, PageAllocator


def test_fresh_allocator_hands_out_lowest_ids_first() -> None:
    a = PageAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) == [3, 4]
    assert (a.total, a.num_free, a.num_used) == (8, 3, 5)
    a.check()


def test_freed_pages_are_reused_first_in_the_order_freed() -> None:
    a = PageAllocator(8)
    a.alloc(6)
    a.free([4, 1])
    assert a.alloc(2) == [4, 1]
    assert a.alloc(1) == [6]
    a.check()


def test_alloc_is_all_or_nothing() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPages) as info:
        a.alloc(2)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.requested, info.value.available) == (2, 1)
    assert "only 1" in str(info.value)
    assert a.num_free == 1
    assert a.alloc(1) == [3]
    a.check()


def test_alloc_zero_and_negative() -> None:
    a = PageAllocator(2)
    assert a.alloc(0) == []
    with pytest.raises(ValueError, match="negative"):
        a.alloc(-1)
    assert a.num_free == 2


def test_empty_pool() -> None:
    a = PageAllocator(0)
    assert a.alloc(0) == []
    with pytest.raises(OutOfPages):
        a.alloc(1)
    a.check()


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_invalid_pool_size(bad: object) -> None:
    with pytest.raises(ValueError):
        PageAllocator(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("to_free", "message"),
    [
        ([5], "not allocated"),  # never handed out
        ([9], "out of range"),
        ([-1], "out of range"),
        ([0, 0], "twice"),
        ([0, 5], "not allocated"),  # one good page, one bad: nothing is freed
    ],
)
def test_bad_free_raises_and_frees_nothing(to_free: list[int], message: str) -> None:
    a = PageAllocator(8)
    a.alloc(2)
    with pytest.raises(ValueError, match=message):
        a.free(to_free)
    assert a.num_used == 2
    assert a.is_allocated(0) and a.is_allocated(1)
    a.check()


def test_double_free_is_an_error() -> None:
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(pages[:1])
    assert a.num_free == 4
    a.check()


def test_all_allocated() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    assert a.all_allocated([0, 1])
    assert not a.all_allocated([1, 2])
    assert a.all_allocated([])


def test_check_detects_a_page_free_twice() -> None:
    a = PageAllocator(4)
    a._free.append(0)  # corrupt on purpose
    with pytest.raises(RuntimeError, match="twice"):
        a.check()


def test_check_detects_a_lost_page() -> None:
    a = PageAllocator(4)
    a._free.remove(2)  # corrupt on purpose
    with pytest.raises(RuntimeError, match="lost"):
        a.check()


def test_check_detects_a_page_both_free_and_allocated() -> None:
    a = PageAllocator(4)
    a.alloc(1)
    a._allocated.add(3)  # corrupt on purpose: 3 is still on the free list
    with pytest.raises(RuntimeError, match="both"):
        a.check()
