"""Scattered query positions (`AttentionBatch.query_positions`, a selective recompute's): the
CPU prefill kernel and every TorchNativeBackend path against a dense float64 reference, at
every ISA tier this machine runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBatch, AttentionShape
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_native import SHORT_EXTEND, TorchNativeBackend
from radixserve.kernels import cpu as cpu_kernel

TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
# (heads, kv_heads, head_dim, dtype): GQA 9/3, head size 128, no GQA, G = 8
SHAPES = [(9, 3, 64, torch.bfloat16), (9, 3, 64, torch.float32), (8, 2, 128, torch.bfloat16),
          (8, 2, 128, torch.float32), (4, 4, 64, torch.float32), (16, 2, 64, torch.float32)]


def _scattered(seq_len: int, count: int, seed: int) -> list[int]:
    """`count` ascending positions below seq_len, the last one seq_len - 1."""
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randperm(seq_len - 1, generator=gen)[: count - 1].sort().values.tolist()
    return [*rest, seq_len - 1]


def _reference(q, k_pool, v_pool, pages, page_size, positions, scale):
    """SDPA in float64 over the gathered context, the token at position p seeing 0 .. p."""
    seq_len = positions[-1] + 1
    pos = torch.arange(seq_len)
    slots = pages[pos // page_size] * page_size + pos % page_size
    k = k_pool[slots].double().transpose(0, 1)[None]
    v = v_pool[slots].double().transpose(0, 1)[None]
    mask = pos[None, :] <= torch.tensor(positions)[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k, v, attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _pool_and_pages(kv_heads, head_dim, page_size, seq_len, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    needed = -(-seq_len // page_size)
    num_pages = needed + 5
    k_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    pages = torch.randperm(num_pages, generator=gen)[:needed]
    return k_pool, v_pool, pages


# (context length, new tokens): a single token, tails inside one key block, several blocks
LENGTHS = [(1, 1), (9, 3), (70, 20), (200, 37), (300, 300)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{h}kv{k}d{d}-{str(t)[6:]}" for h, k, d, t in SHAPES])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"s{s}e{e}" for s, e in LENGTHS])
def test_kernel_with_positions_equals_dense_reference(cpu_tier, shape, page_size, lengths):
    heads, kv_heads, head_dim, dtype = shape
    lib = cpu_kernel.load_library()
    if lib is None or not lib.prefill_attention_supported(head_dim, cpu_kernel.DTYPE_CODES[dtype]):
        pytest.skip(f"the {cpu_tier} build of the prefill kernel does not serve this shape")
    seq_len, new = lengths
    k_pool, v_pool, pages = _pool_and_pages(kv_heads, head_dim, page_size, seq_len, dtype, seed=seq_len)
    positions = _scattered(seq_len, new, seed=new)
    q = torch.randn(new, heads + kv_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)[:, :heads]
    out = torch.full((new, heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    # prefix_len is ignored with positions: pass a wrong one
    cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, page_size, 3, scale, out,
                                 positions=torch.tensor(positions))
    want = _reference(q, k_pool, v_pool, pages, page_size, positions, scale)
    assert (out.double() - want).abs().max() < TOLERANCE[dtype]


def test_kernel_with_contiguous_positions_is_bit_identical_to_without(cpu_tier):
    lib = cpu_kernel.load_library()
    if lib is None or not lib.prefill_attention_supported(64, cpu_kernel.DTYPE_CODES[torch.float32]):
        pytest.skip(f"the {cpu_tier} build of the prefill kernel does not serve fp32 at 64")
    k_pool, v_pool, pages = _pool_and_pages(3, 64, 16, 150, torch.float32, seed=2)
    q = torch.randn(50, 9, 64, generator=torch.Generator().manual_seed(3))
    plain, scattered = torch.empty(50, 9, 64), torch.empty(50, 9, 64)
    cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, 16, 100, 0.125, plain)
    cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, 16, 0, 0.125, scattered,
                                 positions=torch.arange(100, 150))
    assert torch.equal(plain, scattered)


def test_kernel_refuses_bad_positions(cpu_tier):
    lib = cpu_kernel.load_library()
    if lib is None or not lib.prefill_attention_supported(64, cpu_kernel.DTYPE_CODES[torch.float32]):
        pytest.skip(f"the {cpu_tier} build of the prefill kernel does not serve fp32 at 64")
    k_pool, v_pool, pages = _pool_and_pages(3, 64, 16, 40, torch.float32, seed=2)
    q, out = torch.randn(3, 9, 64), torch.empty(3, 9, 64)
    for bad, match in (([5, 5, 9], "ascending"), ([1, 2], r"must be \[3\]"), ([1, 2, 48], "cannot hold")):
        with pytest.raises(ValueError, match=match):
            cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, 16, 0, 0.1, out, positions=torch.tensor(bad))


def test_batch_refuses_bad_positions():
    table = torch.zeros(1, 4, dtype=torch.int64)
    for bad in ([3, 2], [1], [-1, 2], []):
        with pytest.raises(ValueError, match="query positions"):
            AttentionBatch(16, table, [0], [2], [bad])
    batch = AttentionBatch(16, table, [0], [3], [[2, 7, 9]])
    assert batch.seq_lens == [10] and list(batch.positions(0)) == [2, 7, 9]


# backend paths: the C kernels (decode rows for short extends, the prefill kernel past
# SHORT_EXTEND) and SDPA only
PATHS = pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "sdpa"])


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_with_scattered_queries_equals_dense_reference(cpu_tier, use_kernels, dtype, head_dim, page_size,
                                                              monkeypatch):
    """A mixed batch: scattered requests short (decode rows) and long (prefill), a plain prefill
    chunk and a plain decode row beside them; every new K/V lands at its position, every output
    equals the dense reference over the pool as stored."""
    monkeypatch.setattr(cpu_kernel, "torch_owns_bf16_matmuls", lambda: False)
    heads, kv_heads = 8, 2
    shape = AttentionShape(heads, kv_heads, head_dim, scale=head_dim**-0.5)
    seq_lens = [90, 40, 60, 33, 120]
    query_positions = [_scattered(90, 30, 1), _scattered(40, 5, 2), None, None, _scattered(120, SHORT_EXTEND + 1, 3)]
    prefix_lens = [0, 0, 20, 32, 0]
    extend_lens = [30, 5, 40, 1, SHORT_EXTEND + 1]
    per_row = -(-max(seq_lens) // page_size)
    pool = KVPool(1, 5 * per_row + 3, page_size, kv_heads, head_dim, dtype)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=torch.Generator().manual_seed(4)))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=torch.Generator().manual_seed(5)))
    backend = TorchNativeBackend(pool, shape, use_cpu_kernel=use_kernels)
    table = torch.randperm(pool.num_pages, generator=torch.Generator().manual_seed(6))[: 5 * per_row].view(5, per_row)
    batch = AttentionBatch(page_size, table, prefix_lens, extend_lens, query_positions)
    assert batch.seq_lens == seq_lens
    backend.plan(batch)
    tokens = sum(extend_lens)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    out = backend.forward(q, k, v, 0)
    k_pool, v_pool = pool.flat_k(0), pool.flat_v(0)
    start = 0
    for i, extend in enumerate(extend_lens):
        positions = list(batch.positions(i))
        pages = table[i]
        slots = pages[torch.tensor(positions) // page_size] * page_size + torch.tensor(positions) % page_size
        assert torch.equal(k_pool[slots], k[start : start + extend]) and torch.equal(v_pool[slots], v[start : start + extend])
        want = _reference(q[start : start + extend], k_pool, v_pool, pages, page_size, positions, shape.scale)
        assert (out[start : start + extend].double() - want).abs().max() < TOLERANCE[dtype], i
        start += extend


def _mixed_scattered_problem(backend_factory, page_size, dtype, device, head_dim=128):
    """The mixed batch of `test_backend_with_scattered_queries_equals_dense_reference` through a
    backend: its output and its pool."""
    heads, kv_heads = 8, 2
    shape = AttentionShape(heads, kv_heads, head_dim, scale=head_dim**-0.5)
    query_positions = [_scattered(90, 30, 1), None, _scattered(40, 5, 2), None]
    prefix_lens, extend_lens = [0, 20, 0, 32], [30, 40, 5, 1]
    per_row = -(-90 // page_size)
    pool = KVPool(1, 4 * per_row + 3, page_size, kv_heads, head_dim, dtype, device)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=torch.Generator().manual_seed(4)))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=torch.Generator().manual_seed(5)))
    table = torch.randperm(pool.num_pages, generator=torch.Generator().manual_seed(6))[: 4 * per_row].view(4, per_row)
    backend = backend_factory(pool, shape)
    backend.plan(AttentionBatch(page_size, table.to(device), prefix_lens, extend_lens, query_positions))
    gen = torch.Generator().manual_seed(7)
    tokens = sum(extend_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return backend.forward(q, k, v, 0), pool


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_backend_plans_scattered_queries_with_a_custom_mask(page_size, monkeypatch):
    """On the CPU stand-in for flashinfer (tests/fake_flashinfer.py, which honours
    `custom_mask`): the same attention and pool as torch_native."""
    import sys

    import fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    from radixserve.attention.flashinfer_backend import FlashInferBackend

    fi_out, fi_pool = _mixed_scattered_problem(
        lambda pool, shape: FlashInferBackend(pool, shape, workspace_bytes=1024), page_size, torch.float32, "cpu")
    ref_out, ref_pool = _mixed_scattered_problem(TorchNativeBackend, page_size, torch.float32, "cpu")
    torch.testing.assert_close(fi_out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(fi_pool.k[0], ref_pool.k[0]) and torch.equal(fi_pool.v[0], ref_pool.v[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_scattered_queries_on_the_gpu_equal_torch_native(page_size):
    """FlashInfer's custom-mask prefill against torch_native on the GPU (bf16, head size 128)."""
    import os

    if os.environ.get("RADIXSERVE_REQUIRE_FLASHINFER") != "1":
        pytest.importorskip("flashinfer")
    from radixserve.attention.flashinfer_backend import FlashInferBackend

    fi_out, fi_pool = _mixed_scattered_problem(FlashInferBackend, page_size, torch.bfloat16, "cuda")
    ref_out, ref_pool = _mixed_scattered_problem(TorchNativeBackend, page_size, torch.bfloat16, "cuda")
    torch.testing.assert_close(fi_out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(fi_pool.k[0], ref_pool.k[0])
