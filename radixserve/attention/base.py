"""The attention-backend interface: plan once per forward, then one call per layer.

The model never sees page ids. The model runner describes a forward as an `AttentionBatch`, the
backend turns it into whatever indices its kernels want (`plan`), and every attention layer calls
`forward(q, k, v, layer_id)`, which stores the new keys/values in their pages and attends over
each request's whole context (cached prefix + new tokens, causal).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixserve.attention.kv_pool import KVPool


@dataclass(frozen=True)
class AttentionShape:
    """Head layout of the attention layers; the same for every layer of a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


@dataclass(frozen=True)
class AttentionBatch:
    """One forward over a mixed batch, requests in the order their new tokens are packed.

    Request i owns `page_table[i, :ceil(seq_len_i / page_size)]`. Its first `prefix_lens[i]`
    tokens are already stored in those pages; its `extend_lens[i]` new tokens (a prefill chunk,
    or 1 for a decode step) sit at positions `prefix_lens[i] .. seq_len_i - 1`:

        page_size = 4, prefix_len = 6, extend_len = 3
        page_table[i]:  |  p7  |  p2  |  p5  |
        positions:       0123   4567   89
                         cached--- new

    The pages for the new tokens must already be assigned (the scheduler allocates them).

    Scattered queries (a selective recompute, worker/blend.py): where `query_positions[i]` is
    a list, request i's new tokens sit at those positions instead (ascending, as many as
    `extend_lens[i]`), their K/V are stored there, and each attends over positions 0 .. its
    own, the ones between the new tokens already stored; `prefix_lens[i]` is then unused, and
    the request's context ends at its last new token:

        query_positions[i] = [5, 8, 9]
        positions:       0123   4567   89
                         stored    new  new
    """

    page_size: int
    page_table: torch.Tensor  # [B, max_pages] int64, this batch's rows, padded with 0
    prefix_lens: list[int]
    extend_lens: list[int]
    query_positions: list[list[int] | None] | None = None  # per request; None: prefix_len ..

    def __post_init__(self) -> None:
        if self.query_positions is None:
            return
        for i, (pos, extend) in enumerate(zip(self.query_positions, self.extend_lens, strict=True)):
            if pos is not None and (
                len(pos) != extend or not pos or pos[0] < 0 or any(b <= a for a, b in zip(pos, pos[1:]))
            ):
                raise ValueError(f"request {i}: query positions must be {extend} ascending positions, got {pos}")

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def scattered(self) -> bool:
        """True when some request's new tokens sit at explicit positions."""
        return self.query_positions is not None and any(p is not None for p in self.query_positions)

    def positions(self, i: int) -> list[int] | range:
        """The positions of request i's new tokens, ascending."""
        if self.query_positions is not None and self.query_positions[i] is not None:
            return self.query_positions[i]
        return range(self.prefix_lens[i], self.prefix_lens[i] + self.extend_lens[i])

    @property
    def seq_lens(self) -> list[int]:
        """Each request's context length: up to and with its last new token."""
        if not self.scattered:
            return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        return [self.positions(i)[-1] + 1 for i in range(self.batch_size)]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        """True when every request adds exactly one token (a pure decode step)."""
        return all(e == 1 for e in self.extend_lens)


class AttentionBackend(ABC):
    """Paged attention over a `KVPool`. One instance per worker, reused for every forward.

    A backend whose `forward` can be captured in a CUDA graph sets `supports_cuda_graph` and
    implements the two graph methods (see radixserve/worker/cuda_graph.py).
    """

    supports_cuda_graph = False

    def __init__(self, pool: KVPool, shape: AttentionShape) -> None:
        self.pool = pool
        self.shape = shape

    def init_graph_decode(self, batch_sizes: list[int], max_pages_per_request: int) -> None:
        """Allocate the fixed buffers that decode graphs of these batch sizes read."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def plan_graph_decode(self, batch: AttentionBatch) -> None:
        """Like `plan`, for a decode batch of exactly one of the `init_graph_decode` sizes: write
        its indices into the fixed buffers, so a captured `forward` reads them on replay."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> None:
        """Prepare indices for one forward; every layer's `forward` until the next plan uses them."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """Store k, v of the new tokens in their pages and attend.

        q: [T, H, D], k and v: [T, Hkv, D] for the T new tokens of the planned batch.
        Returns [T, H, D].
        """
