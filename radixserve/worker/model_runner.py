"""One forward over a mixed batch of prefill chunks and decode steps, on paged KV; a step with
chunks that reuse cached segments' KV takes the selective forward (worker/blend.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionBackend, AttentionBatch
from radixserve.protocol import SegmentReuse
from radixserve.worker.blend import blend_forward
from radixserve.worker.cuda_graph import DecodeGraphRunner
from radixserve.worker.page_table import PageTable


@dataclass(frozen=True)
class SequenceChunk:
    """The part of one request computed in this forward.

    The request's page-table row must already hold pages for `prefix_len + len(token_ids)`
    tokens; the first `prefix_len` of them (a cache hit, or earlier chunks) are already stored.
    """

    row: int
    prefix_len: int
    token_ids: list[int]
    all_logits: bool = False  # also return logits of every new token (prompt logprobs)
    # segment blending: runs of the chunk whose KV is copied from cached segments (never with
    # all_logits); a step with any takes `blend.blend_forward`
    reuse: tuple[SegmentReuse, ...] = ()


@dataclass(frozen=True)
class ForwardOutput:
    last_logits: torch.Tensor  # [B, V] float32: logits after each chunk's last token
    all_logits: list[torch.Tensor | None]  # per chunk [len(token_ids), V] when asked, else None


class ModelRunner:
    """Runs the model over paged KV. Knows page tables and positions; the model knows neither."""

    def __init__(self, model: torch.nn.Module, page_table: PageTable, backend: AttentionBackend) -> None:
        self.model = model
        self.page_table = page_table
        self.backend = backend
        self.device = backend.pool.device
        self.graphs: DecodeGraphRunner | None = None  # decode steps replayed from CUDA graphs

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int], **graph_options: object) -> None:
        """Capture decode steps of these batch sizes; later decode steps up to the largest
        replay them (padded), every other step runs eagerly."""
        self.graphs = DecodeGraphRunner(
            self.model, self.backend, sizes, self.page_table.max_pages_per_row, **graph_options
        )

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk]) -> ForwardOutput:
        """One forward over every chunk; a step with segment reuse takes the selective forward
        (worker/blend.py), the same single pass for all its chunks. A chunk with reuse has no
        `all_logits`, and when its last token is a copy left as it is (a chunk inside a prompt:
        nothing samples after it) its row of `last_logits` is NaN."""
        if not chunks or any(not c.token_ids for c in chunks):
            raise ValueError("a forward needs at least one chunk, each with at least one new token")
        for c in chunks:
            self._check_pages(c)
        if not any(c.reuse for c in chunks):
            return self._forward(chunks)
        if any(c.reuse and c.all_logits for c in chunks):
            raise ValueError("a chunk with segment reuse returns only its last token's logits")
        out = blend_forward(
            self.model, self.backend, self.page_table.gather([c.row for c in chunks]), [c.prefix_len for c in chunks],
            [c.token_ids for c in chunks], [c.reuse for c in chunks],
        )
        total = sum(len(c.token_ids) for c in chunks)
        row_of = torch.full((total,), -1, dtype=torch.int64)  # packed token -> its row in out.hidden
        row_of[out.rows.cpu()] = torch.arange(len(out.rows))
        wanted: list[int] = []  # rows of out.hidden to run the LM head on
        spans: list[tuple[int, int]] = []
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            rows = row_of[end - len(c.token_ids) : end] if c.all_logits else row_of[end - 1 : end]
            spans.append((len(wanted), len(wanted) + len(rows)))
            wanted += rows.tolist()
        kept = [r for r in wanted if r >= 0]
        logits = self.model.compute_logits(out.hidden[torch.tensor(kept, dtype=torch.int64, device=self.device)])
        full = torch.full((len(wanted), logits.shape[1]), float("nan"), device=self.device)
        full[torch.tensor([i for i, r in enumerate(wanted) if r >= 0], dtype=torch.int64, device=self.device)] = logits
        last_logits = full[torch.tensor([stop - 1 for _, stop in spans], device=self.device)]
        all_logits = [full[a:b] if c.all_logits else None for c, (a, b) in zip(chunks, spans, strict=True)]
        return ForwardOutput(last_logits, all_logits)

    def _check_pages(self, c: SequenceChunk) -> None:
        need = -(-(c.prefix_len + len(c.token_ids)) // self.backend.pool.page_size)
        if self.page_table.num_pages(c.row) < need:
            raise ValueError(
                f"row {c.row} holds {self.page_table.num_pages(c.row)} pages, "
                f"needs {need} for {c.prefix_len + len(c.token_ids)} tokens"
            )

    def _forward(self, chunks: list[SequenceChunk]) -> ForwardOutput:
        """One forward over every chunk (none with reuse)."""
        page_size = self.backend.pool.page_size
        batch = AttentionBatch(
            page_size=page_size,
            page_table=self.page_table.gather([c.row for c in chunks]),
            prefix_lens=[c.prefix_len for c in chunks],
            extend_lens=[len(c.token_ids) for c in chunks],
        )
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        positions = torch.cat(
            [torch.arange(c.prefix_len, c.prefix_len + len(c.token_ids)) for c in chunks]
        ).to(self.device)
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch, input_ids, positions)  # [B, hidden]
        else:
            self.backend.plan(batch)
            hidden = self.model(input_ids, positions, self.backend)  # [T, hidden]

        # one LM head over the rows wanted: each chunk's last, or all of a chunk's that asks
        rows: list[int] = []
        spans: list[tuple[int, int]] = []  # each chunk's rows in `rows`
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            first = end - len(c.token_ids) if c.all_logits else end - 1
            spans.append((len(rows), len(rows) + end - first))
            rows += range(first, end)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)] if len(rows) < len(hidden) else hidden)
        last_logits = logits[torch.tensor([stop - 1 for _, stop in spans], device=self.device)]
        all_logits = [logits[a:b] if c.all_logits else None for c, (a, b) in zip(chunks, spans, strict=True)]
        return ForwardOutput(last_logits, all_logits)
