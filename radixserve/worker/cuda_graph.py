"""CUDA graphs for decode steps: captured once per padded batch size at start-up, then replayed.

A decode step of B requests runs the graph of the smallest captured size S >= B. The B real
requests are followed by S - B padding entries that decode one token at position 0 on the
pool's `pad_page`, so they never touch a request's pages:

    captured sizes [1, 2, 4, 8, 16, 32, 64]; a step of B = 5 replays the S = 8 graph

    input_ids / positions (fixed buffers):  | r0 r1 r2 r3 r4 | pad pad pad |
    page table rows:                        | rows of r0..r4 | pad_page ...|
    hidden states returned:                 | rows 0..4      |  (dropped)  |

Before each replay the backend's `plan_graph_decode` writes the step's indices into the fixed
buffers the captured kernels read; the model's forward itself runs only at capture time.
The bucketing and padding below are pure and CPU-tested; capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from radixserve.attention.base import AttentionBackend, AttentionBatch

log = logging.getLogger("radixserve.worker")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_batch_sizes(max_batch: int, candidates: tuple[int, ...] = GRAPH_BATCH_SIZES) -> list[int]:
    """Sizes to capture: the candidates below `max_batch`, then `max_batch` itself (capped at
    the largest candidate), so every decode step up to that size has a graph."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = min(max_batch, candidates[-1])
    return sorted({c for c in candidates if c < top} | {top})


def padded_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch_size`, or None when none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def pad_decode_batch(batch: AttentionBatch, size: int, pad_page: int) -> AttentionBatch:
    """`batch` followed by `size - B` one-token requests at position 0 on `pad_page`."""
    extra = size - batch.batch_size
    if extra < 0:
        raise ValueError(f"cannot pad a batch of {batch.batch_size} down to {size}")
    if extra == 0:
        return batch
    table = batch.page_table
    pad_rows = torch.full((extra, table.shape[1]), pad_page, dtype=table.dtype, device=table.device)
    return AttentionBatch(
        page_size=batch.page_size,
        page_table=torch.cat([table, pad_rows]),
        prefix_lens=batch.prefix_lens + [0] * extra,
        extend_lens=batch.extend_lens + [1] * extra,
    )


class CudaGraph:
    """torch.cuda.CUDAGraph behind the two calls the runner makes; all graphs share one pool."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()  # warm up off the capture stream, as PyTorch's docs do
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def new_pool() -> object:
        return torch.cuda.graph_pool_handle()


class DecodeGraphRunner:
    """Captures `model(input_ids, positions, backend)` for each decode batch size and replays it.

    `graph_factory(pool)` makes one graph (capture/replay); tests pass an eager stand-in so the
    bucketing, padding and fixed-buffer plumbing run on the CPU.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        sizes: list[int],
        max_pages_per_request: int,
        graph_factory: Callable[[object], CudaGraph] = CudaGraph,
        new_pool: Callable[[], object] = CudaGraph.new_pool,
    ) -> None:
        if not backend.supports_cuda_graph:
            raise ValueError(f"{type(backend).__name__} cannot be captured in CUDA graphs")
        self.model = model
        self.backend = backend
        self.sizes = sorted(sizes)
        device = backend.pool.device
        self.pad_page = backend.pool.pad_page
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        backend.init_graph_decode(self.sizes, max_pages_per_request)
        self.graphs: dict[int, CudaGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden] written by replay
        pool = new_pool()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._capture(size, graph_factory(pool))
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture(self, size: int, graph: CudaGraph) -> None:
        table = torch.full((size, 1), self.pad_page, dtype=torch.int64, device=self.input_ids.device)
        dummy = AttentionBatch(self.backend.pool.page_size, table, [0] * size, [1] * size)
        self.input_ids.zero_()
        self.positions.zero_()
        self.backend.plan_graph_decode(dummy)
        ids, pos = self.input_ids[:size], self.positions[:size]
        self.outputs[size] = graph.capture(lambda: self.model(ids, pos, self.backend))
        self.graphs[size] = graph

    def can_run(self, batch: AttentionBatch) -> bool:
        return batch.is_decode and padded_size(batch.batch_size, self.sizes) is not None

    def run(self, batch: AttentionBatch, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode batch (a view into the graph's output: use it
        before the next replay)."""
        bs = batch.batch_size
        size = padded_size(bs, self.sizes)
        if size is None or not batch.is_decode:
            raise ValueError(f"no decode graph for this batch (B={bs}, sizes {self.sizes})")
        self.input_ids[:bs].copy_(input_ids)
        self.input_ids[bs:size].zero_()  # padding: token 0 at position 0
        self.positions[:bs].copy_(positions)
        self.positions[bs:size].zero_()
        self.backend.plan_graph_decode(pad_decode_batch(batch, size, self.pad_page))
        self.graphs[size].replay()
        return self.outputs[size][:bs]
