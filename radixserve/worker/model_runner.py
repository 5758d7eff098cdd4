"""One forward over a mixed batch of prefill chunks and decode steps, on paged KV; a chunk that
reuses cached segments' KV takes a selective forward of its own (worker/blend.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionBackend, AttentionBatch
from radixserve.protocol import SegmentReuse
from radixserve.worker.blend import blend_chunk
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
    # all_logits); the chunk then runs alone through `blend.blend_chunk`
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
        """The chunks without reuse in one forward, then each chunk with reuse in a selective
        forward of its own (after the others, so it may read a segment they computed); the
        outputs in chunk order. A chunk with reuse has no `all_logits`."""
        if not chunks or any(not c.token_ids for c in chunks):
            raise ValueError("a forward needs at least one chunk, each with at least one new token")
        for c in chunks:
            self._check_pages(c)
        if not any(c.reuse for c in chunks):
            return self._forward(chunks)
        if any(c.reuse and c.all_logits for c in chunks):
            raise ValueError("a chunk with segment reuse returns only its last token's logits")
        plain = [c for c in chunks if not c.reuse]
        out = self._forward(plain) if plain else None
        last: list[torch.Tensor] = []
        all_logits: list[torch.Tensor | None] = []
        at = 0  # the next plain chunk's index in `out`
        for c in chunks:
            if c.reuse:
                pages = self.page_table.gather([c.row])
                logits = blend_chunk(self.model, self.backend, pages, c.prefix_len, c.token_ids, c.reuse).logits
                if logits is None:  # its last token is a copy: a chunk inside the prompt, never sampled
                    logits = torch.full((self.model.config.vocab_size,), float("nan"), device=self.device)
                last.append(logits[None])
                all_logits.append(None)
            else:
                last.append(out.last_logits[at : at + 1])
                all_logits.append(out.all_logits[at])
                at += 1
        return ForwardOutput(torch.cat(last), all_logits)

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
