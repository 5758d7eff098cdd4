"""The CPU paged-decode kernel against SDPA over gathered pages, and its build and fallback."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from radixserve.worker.attention import cpu_kernel

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


def _reference(q, k_pool, v_pool, table, lens, page_size, scale):
    """fp32 SDPA over each request's gathered context."""
    out = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(lens[b]))
        slots = table[b, pos // page_size] * page_size + pos % page_size
        k = k_pool[slots].float().transpose(0, 1)  # [Hkv, L, D]
        v = v_pool[slots].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


def _problem(batch, heads, kv_heads, head_dim, page_size, max_len, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = -(-max_len // page_size)
    num_pages = batch * pages_per_row + 3
    k_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_row].view(batch, -1)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    return q, k_pool, v_pool, table, lens


# (batch, heads, kv_heads, head_dim): register paths (head size 64/128, G <= 8), the portable
# path (head size 32, G = 10), per-head tasks (small batch) and per-request tasks (batch 32)
SHAPES = [(32, 9, 3, 64), (1, 9, 3, 64), (3, 8, 2, 128), (5, 6, 6, 32), (2, 20, 2, 64), (9, 4, 4, 64)]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # bf16: the output's own rounding


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{b}h{h}kv{k}d{d}" for b, h, k, d in SHAPES])
def test_kernel_equals_sdpa_over_gathered_pages(shape, page_size, dtype):
    q, k_pool, v_pool, table, lens = _problem(*shape, page_size, 75, dtype)
    scale = shape[3] ** -0.5
    got = cpu_kernel.paged_decode(q, k_pool, v_pool, table, lens, page_size, scale)
    want = _reference(q, k_pool, v_pool, table, lens, page_size, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - want).abs().max() < TOLERANCE[dtype]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_stores_the_new_token_then_attends_to_it(dtype):
    """k_new/v_new given as strided views (as the model's fused projection makes them) land in
    the slot of position seq_len - 1, and the attention sees them."""
    batch, heads, kv_heads, dim, ps = 6, 4, 2, 64, 16
    q, k_pool, v_pool, table, lens = _problem(batch, heads, kv_heads, dim, ps, 40, dtype, seed=3)
    fused = torch.randn(batch, 2 * kv_heads * dim + 7).to(dtype)  # [k | v | junk] per row
    k_new = fused[:, : kv_heads * dim].view(batch, kv_heads, dim)
    v_new = fused[:, kv_heads * dim : 2 * kv_heads * dim].view(batch, kv_heads, dim)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    got = cpu_kernel.paged_decode(q, k_pool, v_pool, table, lens, ps, 0.125, k_new=k_new, v_new=v_new)
    last = lens - 1
    slots = table[torch.arange(batch), last // ps] * ps + last % ps
    before_k[slots], before_v[slots] = k_new, v_new
    assert torch.equal(k_pool, before_k) and torch.equal(v_pool, before_v)  # only those rows
    want = _reference(q, k_pool, v_pool, table, lens, ps, 0.125)
    assert (got.float() - want).abs().max() < TOLERANCE[dtype]


@needs_compiler
def test_kernel_rejects_mismatched_inputs():
    q, k_pool, v_pool, table, lens = _problem(2, 4, 2, 64, 16, 20, torch.float32)
    with pytest.raises(ValueError, match="both"):
        cpu_kernel.paged_decode(q, k_pool, v_pool, table, lens, 16, 0.1, k_new=q[:, :2])
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernel.paged_decode(q[:, :3], k_pool, v_pool, table, lens, 16, 0.1)
    with pytest.raises(ValueError, match="new K/V"):
        cpu_kernel.paged_decode(q, k_pool, v_pool, table, lens, 16, 0.1, k_new=q, v_new=q)


@needs_compiler
def test_kernel_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    cpu_kernel.load_paged_decode.cache_clear()
    try:
        assert cpu_kernel.load_paged_decode() is not None
        built = list((tmp_path / "kernels").glob("paged_decode-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_kernel.load_paged_decode.cache_clear()
        assert cpu_kernel.load_paged_decode() is not None
        assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    finally:
        cpu_kernel.load_paged_decode.cache_clear()


@pytest.mark.parametrize("cause", ["no_compiler", "build_fails", "disabled"])
def test_without_the_kernel_torch_native_falls_back(tmp_path, monkeypatch, caplog, cause):
    from radixserve.worker.attention.base import AttentionShape
    from radixserve.worker.attention.torch_native import TorchNativeBackend
    from radixserve.worker.kv_pool import KVPool

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    if cause == "no_compiler":
        monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    elif cause == "build_fails":
        monkeypatch.setattr(cpu_kernel, "_compiler", lambda: "false")  # a compiler that fails
    else:
        monkeypatch.setenv("RADIXSERVE_DISABLE_CPU_KERNEL", "1")
    cpu_kernel.load_paged_decode.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="radixserve.worker"):
            backend = TorchNativeBackend(KVPool(1, 8, 4, 2, 64, torch.float32), AttentionShape(4, 2, 64, 0.125))
        assert not backend.uses_cpu_kernel
        if cause != "disabled":
            assert "gather + SDPA" in caplog.text
    finally:
        cpu_kernel.load_paged_decode.cache_clear()
