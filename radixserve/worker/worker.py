"""The worker: model weights, KV pool, page tables, attention backend and sampler.

It applies the scheduler's per-step diffs to its mirror of the page tables, runs one forward,
samples, and answers with token ids. It never decides anything about memory.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from radixserve.attention import create_backend
from radixserve.attention.kv_pool import KVPool
from radixserve.config import ServerConfig
from radixserve.kernels import isa
from radixserve.kernels.kv_quant import kv_format
from radixserve.protocol import (
    Chunk,
    ChunkResult,
    ForwardBatch,
    ForwardResult,
    WorkerInfo,
    WorkerReady,
)
from radixserve.worker.blend import blend_copy_cost
from radixserve.worker.cuda_graph import graph_batch_sizes
from radixserve.worker.device import dtype_name, resolve_device, resolve_dtype
from radixserve.worker.kv_disk import DiskStore, model_key
from radixserve.worker.model_runner import ModelRunner, SequenceChunk
from radixserve.worker.page_table import PageTable
from radixserve.worker.sampler import SampleOutput, Sampler, SamplingState, token_logprobs

if TYPE_CHECKING:
    from radixserve.models.loader import LoadedModel

log = logging.getLogger("radixserve.worker")

# A test-only hook: a step whose chunks hold this token id raises, as a kernel bug would, so the
# tests of engine recovery can mark a poison request by a token of its prompt. Never set it in
# production.
FAIL_ON_TOKEN_ENV = "RADIXSERVE_TEST_FAIL_ON_TOKEN"


class Worker:
    def __init__(self, config: ServerConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded`: an already built model (benchmarks with random weights) instead of
        loading `config.model`; it must be in the dtype and on the device `config` resolves to."""
        from radixserve.models.loader import load_model  # heavy import, only in the worker

        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            loaded = load_model(config.model, dtype=self.dtype, device=self.device, quantization=config.quantization)
        self.model_path = str(loaded.path)
        self.weight_format = loaded.weight_format
        mc = loaded.config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(mc.eos_token_ids)
        shape = loaded.model.attention_shape()
        self.kv_format = kv_format(config.kv_cache_dtype, self.dtype)
        page_bytes = KVPool.bytes_per_page(
            mc.num_layers, config.page_size, shape.num_kv_heads, shape.head_dim, self.kv_format
        )
        num_pages = config.kv_pages or max(2, int(config.kv_memory_gb * 2**30) // page_bytes)
        # one request must always fit in the pool on its own, so retraction can always make progress
        self.context_len = min(config.context_len or mc.max_position_embeddings, num_pages * config.page_size)
        self.pool = KVPool(
            mc.num_layers, num_pages, config.page_size, shape.num_kv_heads, shape.head_dim,
            self.dtype, self.device, self.kv_format,
        )
        self.page_table = PageTable(
            config.max_running_requests, -(-self.context_len // config.page_size), self.device
        )
        self.disk: DiskStore | None = None
        self.disk_pages: list[bytes] = []
        if config.kv_disk_dir:
            weights = sorted(loaded.path.glob("*.safetensors")) + [loaded.path / "config.json"]
            self.disk = DiskStore(config.kv_disk_dir, self.pool, model_key(weights, self.pool, self.weight_format))
            self.disk_pages = self.disk.scan()
            log.info("kv disk tier: %s, %d pages found", self.disk.dir, len(self.disk_pages))
        backend = create_backend(config.attention_backend, self.pool, shape, self.device)
        self.runner = ModelRunner(loaded.model, self.page_table, backend)
        if self.device.type == "cuda" and backend.supports_cuda_graph and not config.disable_cuda_graph:
            self.runner.capture_decode_graphs(graph_batch_sizes(config.max_running_requests))
        self.sampler = Sampler(self.vocab_size)
        self.sampler.seed(config.seed)
        self.states: dict[str, SamplingState] = {}
        fail_on = os.environ.get(FAIL_ON_TOKEN_ENV)
        self._fail_on_token = int(fail_on) if fail_on else None
        log.info(
            "worker ready: model %s, %s on %s (CPU ISA %s), weights %s, %s attention%s, KV pool %d pages x "
            "%d tokens = %d tokens of %s KV (%.2f GiB)",
            self.model_path, dtype_name(self.dtype), self.device, isa.selected_tier(), self.weight_format,
            type(backend).__name__,
            ", decode CUDA graphs" if self.runner.graphs is not None else _cpu_kernels_used(backend),
            num_pages, config.page_size, num_pages * config.page_size, self.kv_format.name,
            num_pages * page_bytes / 2**30,
        )

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            WorkerInfo(
                total_pages=self.pool.num_pages,
                page_size=self.pool.page_size,
                context_len=self.context_len,
                vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
                model_path=self.model_path,
                dtype=dtype_name(self.dtype),
                device=str(self.device),
                kv_cache_dtype=self.kv_format.name,
                weight_format=self.weight_format,
                cpu_isa=str(isa.selected_tier()),
                blend_copy_cost=blend_copy_cost(len(self.runner.model.layers)),
                context_token_cost=self.runner.model.config.context_token_cost,
            ),
            kv_model_key=self.disk.key if self.disk else b"",
            disk_pages=self.disk_pages,
            disk_page_bytes=self.disk.file_bytes if self.disk else 0,
        )

    def close(self) -> None:
        """At a stop: finish the disk tier's writes (the scheduler sent the last ones)."""
        if self.disk is not None:
            self.disk.close()

    def step(self, batch: ForwardBatch) -> ForwardResult:
        start = time.perf_counter()
        self._apply(batch)
        if batch.disk is not None and self.disk is not None:
            self.disk.apply(batch.disk)  # before the forward: it may reuse the pages stored
        if self._fail_on_token is not None and any(self._fail_on_token in c.token_ids for c in batch.chunks):
            raise RuntimeError(f"{FAIL_ON_TOKEN_ENV}: a chunk holds token {self._fail_on_token}")
        results = [ChunkResult() for _ in batch.chunks]
        if batch.chunks:
            self._run(batch, results)
        report = self.disk.report() if self.disk is not None else None
        return ForwardResult(results, time.perf_counter() - start, report)

    def _apply(self, batch: ForwardBatch) -> None:
        for row in batch.released:
            self.page_table.release(row)
        for rid in batch.finished:
            self.states.pop(rid, None)
        for new in batch.new_requests:
            self.states[new.rid] = SamplingState(
                new.sampling, new.prompt_ids, list(new.output_ids), top_logprobs_num=new.top_logprobs_num,
                return_logprob=new.return_logprob,
            )
        for row, pages in batch.assigned:
            self.page_table.assign(row, pages)
        for row, pages in batch.appended:
            self.page_table.append(row, pages)

    def _run(self, batch: ForwardBatch, results: list[ChunkResult]) -> None:
        for c in batch.chunks:
            if c.reuse and (c.draft_len or c.input_logprobs_from >= 0):
                raise ValueError(f"chunk of {c.rid}: segment reuse never comes with a draft or input logprobs")
            if c.reuse and c.sample and c.reuse[-1].position + c.reuse[-1].length == c.prefix_len + len(c.token_ids):
                raise ValueError(f"chunk of {c.rid}: a chunk that samples must compute its last token, not copy it")
        out = self.runner.forward(
            [
                SequenceChunk(c.row, c.prefix_len, c.token_ids, all_logits=c.input_logprobs_from >= 0 or c.draft_len > 0,
                              reuse=tuple(c.reuse))
                for c in batch.chunks
            ]
        )
        sampling = [i for i, c in enumerate(batch.chunks) if c.sample]
        if sampling:
            self._sample(batch.chunks, sampling, out.last_logits, out.all_logits, results)
        for i, c in enumerate(batch.chunks):
            if c.input_logprobs_from >= 0:
                self._input_logprobs(c, out.all_logits[i], results[i])

    def _sample(
        self, chunks: list[Chunk], sampling: list[int], last_logits: torch.Tensor,
        all_logits: list[torch.Tensor | None], results: list[ChunkResult],
    ) -> None:
        """The step's draws, all in one sampler call: one after each sampling chunk, and one
        after each position of a draft being checked (`_draft_draws`)."""
        chunks_sampled = [chunks[i] for i in sampling]
        if not any(c.draft_len for c in chunks_sampled):
            states = [self.states[c.rid] for c in chunks_sampled]
            logits = last_logits[sampling]
            bitmasks = [c.token_bitmask for c in chunks_sampled]
        else:
            states, rows, bitmasks = [], [], []
            for i, c in zip(sampling, chunks_sampled, strict=True):
                if c.draft_len:
                    states += self._draft_draws(c)
                    rows.append(all_logits[i][-(c.draft_len + 1) :])
                    bitmasks += [b""] * (c.draft_len + 1)  # a constrained request never drafts
                else:
                    states.append(self.states[c.rid])
                    rows.append(last_logits[i : i + 1])
                    bitmasks.append(c.token_bitmask)
            logits = torch.cat(rows)
        sampled = self.sampler.sample(logits, states, bitmasks)
        at = 0
        for i, c in zip(sampling, chunks_sampled, strict=True):
            draws = c.draft_len + 1
            self._take_draws(c, sampled, at, draws, results[i])
            at += draws

    def _draft_draws(self, chunk: Chunk) -> list[SamplingState]:
        """The sampling states of a draft's draws: after the last known token, and after each
        draft token as if the draft up to it had been sampled (its penalties count them, and a
        seeded draw is the one of that step). The draw after position j is kept only when the
        draws before it all matched the draft, so every kept token is the one plain decoding
        would sample there: the same for greedy and seeded sampling, and from the same
        distribution otherwise (a later draw of the shared generator is independent of the
        ones it replaces)."""
        state = self.states[chunk.rid]
        draft = chunk.token_ids[-chunk.draft_len :]
        return [state] + [replace(state, output_ids=state.output_ids + draft[:j]) for j in range(1, len(draft) + 1)]

    def _take_draws(self, chunk: Chunk, sampled: SampleOutput, at: int, draws: int, result: ChunkResult) -> None:
        """A chunk's draws `at:at + draws` of `sampled`: without a draft its next token; with one,
        the draws that matched the draft up to the first that does not (or the last), which is
        the next token."""
        tokens = sampled.token_ids[at : at + draws]
        draft = chunk.token_ids[len(chunk.token_ids) - chunk.draft_len :]
        kept = next((j for j, (token, want) in enumerate(zip(tokens[:-1], draft, strict=True)) if token != want), len(draft))
        self.states[chunk.rid].output_ids.extend(tokens[: kept + 1])
        logprobs, top = sampled.logprobs.logprobs[at : at + draws], sampled.logprobs.top[at : at + draws]
        result.next_token_id, result.logprob, result.top_logprobs = tokens[kept], logprobs[kept], top[kept]
        if kept:
            result.accepted_ids, result.accepted_logprobs, result.accepted_top_logprobs = tokens[:kept], logprobs[:kept], top[:kept]

    def _input_logprobs(self, chunk, logits: torch.Tensor, result: ChunkResult) -> None:
        """Logprob of each token after position `input_logprobs_from` of the chunk, given the tokens before it.

        The last position's target is `next_token_id` when the chunk does not end the prompt;
        when it does, that position scores the sampled output token instead (an output logprob),
        or nothing at all (max_new_tokens 0).
        """
        targets = chunk.token_ids[chunk.input_logprobs_from + 1 :]
        if not chunk.sample and chunk.next_token_id >= 0:
            targets = targets + [chunk.next_token_id]
        if not targets:
            return
        rows = logits[chunk.input_logprobs_from : chunk.input_logprobs_from + len(targets)]
        top_n = self.states[chunk.rid].top_logprobs_num
        lp = token_logprobs(rows, torch.tensor(targets, device=rows.device), [top_n] * len(targets))
        result.input_logprobs = lp.logprobs
        result.input_top_logprobs = lp.top


def _cpu_kernels_used(backend: object) -> str:
    """' (CPU decode and prefill kernels)' or the part that applies, for the ready log line."""
    used = [name for name, flag in (("decode", "uses_cpu_kernel"), ("prefill", "uses_prefill_kernel"))
            if getattr(backend, flag, False)]
    if not used:
        return ""
    return f" (CPU {' and '.join(used)} kernel{'s' if len(used) > 1 else ''})"
