"""Reference attention for the kernel tests: plain SDPA over each request's gathered context."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           lens: torch.Tensor, page_size: int, scale: float,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One decode query per request (q [B, H, D]) over its first lens[b] positions, whose slots
    the page table gives in the pools ([slots, Hkv, D]); SDPA in `dtype`. Returns [B, H, D]."""
    out = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(lens[b]))
        slots = table[b, pos // page_size] * page_size + pos % page_size
        k = k_pool[slots].to(dtype).transpose(0, 1)  # [Hkv, L, D]
        v = v_pool[slots].to(dtype).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].to(dtype)[:, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)
