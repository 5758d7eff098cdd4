"""Per-request page tables: the worker's mirror of the scheduler's page assignments."""

from __future__ import annotations

import torch


class PageTable:
    """One row of page ids per running request.

    The scheduler decides which row a request uses and which pages it owns; the worker applies
    those decisions as deltas (`assign`, `append`, `release`) so per-step messages stay
    O(batch), never O(context). Row r's first `num_pages(r)` entries are its pages in order.
    """

    def __init__(self, max_rows: int, max_pages_per_row: int, device: torch.device | str = "cpu") -> None:
        if max_rows < 1 or max_pages_per_row < 1:
            raise ValueError(f"page table needs >= 1 row and page, got {max_rows} x {max_pages_per_row}")
        self.max_rows = max_rows
        self.max_pages_per_row = max_pages_per_row
        self.table = torch.zeros((max_rows, max_pages_per_row), dtype=torch.int64, device=device)
        self._lengths = [0] * max_rows

    def num_pages(self, row: int) -> int:
        return self._lengths[row]

    def pages(self, row: int) -> list[int]:
        return self.table[row, : self._lengths[row]].tolist()

    def assign(self, row: int, pages: list[int]) -> None:
        """Give `row` exactly these pages (a new or resumed request), replacing what it had."""
        self._check_row(row)
        self._lengths[row] = 0
        self.append(row, pages)

    def append(self, row: int, pages: list[int]) -> None:
        """Add pages at the end of `row` (its context grew past its last page)."""
        self._check_row(row)
        start = self._lengths[row]
        end = start + len(pages)
        if end > self.max_pages_per_row:
            raise ValueError(f"row {row} would hold {end} pages, more than {self.max_pages_per_row}")
        if pages:
            self.table[row, start:end] = torch.tensor(pages, dtype=torch.int64)
        self._lengths[row] = end

    def release(self, row: int) -> None:
        """Forget `row`'s pages; the scheduler owns what happens to the pages themselves."""
        self._check_row(row)
        self._lengths[row] = 0

    def gather(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), max pages among them] page ids of these rows, padded with row data past their end."""
        width = max(1, max(self._lengths[r] for r in rows))
        index = torch.tensor(rows, dtype=torch.int64, device=self.table.device)
        return self.table[index, :width]

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_rows:
            raise ValueError(f"page-table row {row} out of range [0, {self.max_rows})")
