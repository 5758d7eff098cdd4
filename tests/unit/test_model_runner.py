"""Paged KV through the model runner: chunking, cached prefixes and mixed batches change nothing."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_native import SHORT_EXTEND, TorchNativeBackend
from radixserve.kernels.cpu import load_library
from radixserve.models.loader import load_model
from radixserve.models.packed_linear import OneDNNLinear, PanelLinear
from radixserve.worker.model_runner import ModelRunner, SequenceChunk
from radixserve.worker.page_table import PageTable

ATOL = 1e-4  # fp32; observed differences are ~1e-6


class Harness:
    """A runner over a shuffled page pool, so requests never get contiguous pages."""

    def __init__(
        self, model_dir, page_size: int, num_pages: int = 512, seed: int = 0, cpu_kernel: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        loaded = load_model(str(model_dir), dtype=dtype)
        self.model = loaded.model
        shape = self.model.attention_shape()
        self.pool = KVPool(loaded.config.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, dtype)
        self.table = PageTable(8, num_pages)
        self.runner = ModelRunner(self.model, self.table, TorchNativeBackend(self.pool, shape, cpu_kernel))
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.page_size = page_size

    def give_pages(self, row: int, num_tokens: int) -> None:
        need = -(-num_tokens // self.page_size) - self.table.num_pages(row)
        self.table.append(row, [self.free.pop() for _ in range(max(0, need))])

    def run_chunks(self, row: int, tokens: list[int], sizes: list[int]) -> torch.Tensor:
        """Compute `tokens` in chunks of `sizes`; return logits of every position."""
        out, done = [], 0
        for size in sizes:
            piece = tokens[done : done + size]
            self.give_pages(row, done + len(piece))
            res = self.runner.forward([SequenceChunk(row, done, piece, all_logits=True)])
            out.append(res.all_logits[0])
            torch.testing.assert_close(res.last_logits[0], res.all_logits[0][-1])
            done += len(piece)
        return torch.cat(out)


def kernel_available() -> bool:
    return load_library() is not None


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# decode attention: the C kernel (radixserve/kernels/cpu.py) and the gather + SDPA fallback
DECODE_PATHS = pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "sdpa"])


@DECODE_PATHS
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunking_and_cached_prefix_give_same_logits(tiny_model_dirs, page_size, cpu_kernel):
    h = Harness(tiny_model_dirs["llama_gqa_tied"], page_size, cpu_kernel=cpu_kernel)
    tokens = _tokens(45, h.model.config.vocab_size, 1)
    one_shot = h.run_chunks(0, tokens, [45])
    hf = _hf_logits(tiny_model_dirs["llama_gqa_tied"], tokens)
    assert (one_shot - hf).abs().max() < ATOL
    # [7, ..., 10], [40, 2, 2, 1]: short extends over a cached prefix, as a checked draft is (decode
    # rows on the kernel); [20, 25]: past SHORT_EXTEND, the prefill kernel over a cached prefix
    for row, sizes in enumerate([[1] * 45, [7, 7, 7, 7, 7, 10], [20, 25], [44, 1], [40, 2, 2, 1]], start=1):
        chunked = h.run_chunks(row, tokens, sizes)
        assert (chunked - one_shot).abs().max() < ATOL, sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_checked_draft_computes_what_decoding_token_by_token_does(tiny_model_dirs, page_size, dtype):
    """On the CPU kernels, a short extend over a cached prefix (a draft being checked) gives bit
    for bit the logits of its tokens decoded one step at a time: its rows are decode rows, and
    the panel linears sum each row alone. So speculation keeps plain decoding's tokens, bf16
    included (where torch's matmuls serve instead, only to rounding)."""
    h = Harness(tiny_model_dirs["llama_gqa_tied"], page_size, dtype=dtype)
    linears = _linears(h.model)
    assert linears
    if not (h.runner.backend.uses_cpu_kernel and all(isinstance(m, PanelLinear) for m in linears)):
        pytest.skip("needs the CPU attention kernels and the panel linears for this dtype")
    tokens = _tokens(40 + SHORT_EXTEND, h.model.config.vocab_size, 3)
    stepwise = h.run_chunks(0, tokens, [40] + [1] * SHORT_EXTEND)[40:]
    for row, sizes in enumerate([[40, SHORT_EXTEND], [40, 3, SHORT_EXTEND - 3]], start=1):
        assert torch.equal(h.run_chunks(row, tokens, sizes)[40:], stepwise), sizes


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear layers (packed or not), the LM head included."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear | PanelLinear | OneDNNLinear)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_already_in_pages(tiny_model_dirs, page_size):
    """A second request reusing the first one's prefix pages (a cache hit) gets the same logits."""
    h = Harness(tiny_model_dirs["qwen2"], page_size)
    tokens = _tokens(40, h.model.config.vocab_size, 2)
    full = h.run_chunks(0, tokens, [40])
    shared = 32  # page-aligned for both page sizes
    h.table.assign(1, h.table.pages(0)[: shared // page_size])
    h.give_pages(1, 40)
    res = h.runner.forward([SequenceChunk(1, shared, tokens[shared:], all_logits=True)])
    assert (res.all_logits[0] - full[shared:]).abs().max() < ATOL


@DECODE_PATHS
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_equals_each_request_alone(tiny_model_dirs, page_size, cpu_kernel):
    alone = Harness(tiny_model_dirs["qwen3"], page_size, seed=1, cpu_kernel=cpu_kernel)
    batch = Harness(tiny_model_dirs["qwen3"], page_size, seed=2, cpu_kernel=cpu_kernel)
    vocab = alone.model.config.vocab_size
    # (tokens, how much is already computed before the mixed step)
    cases = [(_tokens(30, vocab, 10), 29), (_tokens(20, vocab, 11), 0), (_tokens(50, vocab, 12), 16),
             (_tokens(17, vocab, 13), 16), (_tokens(5, vocab, 14), 0), (_tokens(24, vocab, 15), 22)]
    expected = [alone.run_chunks(i, toks, [len(toks)]) for i, (toks, _) in enumerate(cases)]
    chunks = []
    for i, (toks, done) in enumerate(cases):
        if done:
            batch.run_chunks(i, toks[:done], [done])
        batch.give_pages(i, len(toks))
        chunks.append(SequenceChunk(i, done, toks[done:], all_logits=i != 2))
    res = batch.runner.forward(chunks)
    assert batch.runner.backend.uses_cpu_kernel == (cpu_kernel and kernel_available())
    for i, (_, done) in enumerate(cases):
        if i == 2:
            assert res.all_logits[i] is None  # only its last position's logits were asked for
        else:
            assert (res.all_logits[i] - expected[i][done:]).abs().max() < ATOL, i
        assert (res.last_logits[i] - expected[i][-1]).abs().max() < ATOL, i


def test_runner_rejects_missing_pages(tiny_model_dirs):
    h = Harness(tiny_model_dirs["llama"], 4)
    h.give_pages(0, 4)
    with pytest.raises(ValueError, match="needs 2"):
        h.runner.forward([SequenceChunk(0, 0, [1, 2, 3, 4, 5])])


def _hf_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]
