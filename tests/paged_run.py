"""Drive one of our models through the paged attention backend in process, as the model runner
does, without a scheduler: the tests that compare logits or greedy tokens of two models."""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBatch
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.models import LlamaForCausalLM


class PagedRun:
    """Drives a model through the paged backend like the runner does: a pool, per-request page
    rows (deliberately scattered), and forwards over packed new tokens."""

    def __init__(self, model: LlamaForCausalLM, page_size: int = 16, num_pages: int = 64) -> None:
        self.model = model
        shape = model.attention_shape()
        dtype = model.norm.weight.dtype  # the embedding may be quantized blocks
        self.pool = KVPool(
            model.config.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, dtype
        )
        self.backend = TorchNativeBackend(self.pool, shape)
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
        self.pages: list[list[int]] = []  # per request
        self.lens: list[int] = []  # tokens already stored, per request

    def add_request(self) -> int:
        self.pages.append([])
        self.lens.append(0)
        return len(self.pages) - 1

    @torch.inference_mode()
    def forward(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Request id -> its new tokens; returns request id -> logits [len(new), vocab]."""
        rids = list(new_tokens)
        ps = self.pool.page_size
        for r in rids:
            while len(self.pages[r]) * ps < self.lens[r] + len(new_tokens[r]):
                self.pages[r].append(self.free.pop())
        width = max(len(self.pages[r]) for r in rids)
        table = torch.tensor([self.pages[r] + [0] * (width - len(self.pages[r])) for r in rids])
        prefix = [self.lens[r] for r in rids]
        extend = [len(new_tokens[r]) for r in rids]
        self.backend.plan(AttentionBatch(ps, table, prefix, extend))
        ids = torch.tensor([t for r in rids for t in new_tokens[r]])
        positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)])
        logits = self.model.compute_logits(self.model(ids, positions, self.backend))
        for r, e in zip(rids, extend, strict=True):
            self.lens[r] += e
        return dict(zip(rids, logits.split(extend), strict=True))


def greedy(model: LlamaForCausalLM, chunks: list[list[int]], new_tokens: int, page_size: int = 16,
           num_pages: int = 64) -> list[int]:
    """`new_tokens` greedy tokens after a prompt computed as `chunks`, one forward each (as a
    server splits a prompt between its cache and its prefill), then one decode step a token."""
    run = PagedRun(model, page_size, num_pages)
    r = run.add_request()
    for chunk in chunks:
        logits = run.forward({r: chunk})[r][-1]
    return _decode_greedy(run, {r: logits}, new_tokens)[r]


def greedy_each(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int, page_size: int = 16,
                num_pages: int = 64) -> list[list[int]]:
    """`greedy` for each of `prompts`, their decode steps batched (one forward a step for all of
    them, as a server decodes), each prompt's prefill a forward of its own. Where a row's logits
    do not depend on the rows beside it (the CPU kernels' linears and decode attention), each
    answer is the one `greedy` gives."""
    run = PagedRun(model, page_size, num_pages)
    rids = [run.add_request() for _ in prompts]
    logits = {r: run.forward({r: p})[r][-1] for r, p in zip(rids, prompts, strict=True)}
    out = _decode_greedy(run, logits, new_tokens)
    return [out[r] for r in rids]


def _decode_greedy(run: PagedRun, logits: dict[int, torch.Tensor], new_tokens: int) -> dict[int, list[int]]:
    """From each request's last logits, `new_tokens` greedy tokens, one decode step a token for
    all of them together."""
    out: dict[int, list[int]] = {r: [] for r in logits}
    for _ in range(new_tokens):
        for r, row in logits.items():
            out[r].append(int(row.argmax()))
        logits = {r: rows[-1] for r, rows in run.forward({r: [out[r][-1]] for r in out}).items()}
    return out
