"""Index arrays of one forward over paged KV, in the CSR form FlashInfer's wrappers take.

Pure torch, so the CPU tests check it exactly; the lengths come from the batch's Python lists
(the host knows them), the page ids come from the worker's page table (on the GPU there).

    page_size = 4, two requests packed as [req0's 3 new tokens | req1's 1 new token]

    req0: prefix 5, extend 3 -> seq 8, pages [p7 p2]      positions 0123 4567
    req1: prefix 4, extend 1 -> seq 5, pages [p3 p9]      positions 0123 4
                                                                     ^new

    qo_indptr        [0, 3, 4]         new tokens of request i: q[qo_indptr[i]:qo_indptr[i+1]]
    kv_indptr        [0, 2, 4]         pages of request i: kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices       [7, 2, 3, 9]
    kv_last_page_len [4, 1]            tokens used in each request's last page (1..page_size)
    out_slots        [2*4+1, 2*4+2, 2*4+3, 9*4+0]   flat slot (page * page_size + offset) of
                                                    each new token, where its K/V are written

With scattered queries (`AttentionBatch.query_positions`) a request's KV ends at its last new
token, each new token's slot is its own position's, and `causal_mask` says which keys each
new token sees (FlashInfer's bottom-right causal alignment would be wrong there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionBatch


@dataclass(frozen=True)
class PagedIndices:
    """CSR description of one batch; indptr arrays stay on the host (FlashInfer's `plan` reads
    them there), page ids and slots live on the pool's device."""

    qo_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indptr: torch.Tensor  # [B + 1] int32, host
    kv_last_page_len: torch.Tensor  # [B] int32, host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, device
    out_slots: torch.Tensor  # [T] int64, device: flat KV slot of each new token


def build_paged_indices(batch: AttentionBatch, device: torch.device | str) -> PagedIndices:
    """Every index array of `batch`; one host-to-device copy, then gathers on the device.

    `batch.page_table` may hold stale entries past each request's last page (rows are padded
    with old data); only the first ceil(seq_len / page_size) entries of each row are read.
    """
    ps = batch.page_size
    table = batch.page_table  # [B, W]
    width = table.shape[1]
    extend = torch.tensor(batch.extend_lens, dtype=torch.int64)  # [B]
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)  # [B]
    seq = torch.tensor(batch.seq_lens, dtype=torch.int64) if batch.scattered else prefix + extend
    num_pages = (seq + ps - 1) // ps  # [B]
    if bool((num_pages > width).any()):
        raise ValueError(f"a request needs {int(num_pages.max())} pages, the page table has {width}")
    qo_indptr = _indptr(extend)
    kv_indptr = _indptr(num_pages)
    last_page_len = seq - (num_pages - 1) * ps

    rows = torch.arange(len(batch.extend_lens))
    # kv_indices[j] = table[r, j - kv_indptr[r]] for the request r that owns page j
    page_rows = torch.repeat_interleave(rows, num_pages)
    page_cols = torch.arange(int(kv_indptr[-1])) - kv_indptr[page_rows]
    # new token t of request r sits at position prefix[r] + (t - qo_indptr[r])
    tok_rows = torch.repeat_interleave(rows, extend)
    if batch.scattered:  # or at its own position (AttentionBatch.query_positions)
        tok_pos = torch.tensor([p for i in range(batch.batch_size) for p in batch.positions(i)], dtype=torch.int64)
    else:
        tok_pos = torch.arange(int(qo_indptr[-1])) - qo_indptr[tok_rows] + prefix[tok_rows]
    host = torch.cat([page_rows * width + page_cols, tok_rows * width + tok_pos // ps, tok_pos % ps])
    dev = host.to(device, non_blocking=True)
    n_pages, n_tok = page_rows.numel(), tok_rows.numel()
    flat_table = table.reshape(-1).to(device)
    kv_indices = flat_table[dev[:n_pages]].to(torch.int32)
    out_slots = flat_table[dev[n_pages : n_pages + n_tok]] * ps + dev[n_pages + n_tok :]
    return PagedIndices(
        qo_indptr=qo_indptr.to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_last_page_len=last_page_len.to(torch.int32),
        kv_indices=kv_indices,
        out_slots=out_slots,
    )


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    """[0, l0, l0 + l1, ...]: int64 [len + 1]."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def causal_mask(batch: AttentionBatch) -> torch.Tensor:
    """FlashInfer's flattened custom mask of `batch` (host, bool): per request, row-major
    [extend_len, seq_len], True where the new token's position is at or past the key's."""
    parts = []
    for i, seq_len in enumerate(batch.seq_lens):
        positions = torch.tensor(list(batch.positions(i)), dtype=torch.int64)
        parts.append((torch.arange(seq_len)[None, :] <= positions[:, None]).flatten())
    return torch.cat(parts)
