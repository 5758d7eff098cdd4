"""The CPU kernels (radixserve/kernels): paged decode and RMSNorm against torch, build and fallback."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from attention_reference import paged_decode_reference

from radixserve.kernels import cpu as cpu_kernel
from radixserve.kernels import isa

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


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


# (batch, heads, kv_heads, head_dim): register paths (head size 64/128, G <= 8; G = 8 at head
# size 128 splits P.V into the most tiles), the portable path (head size 32, G = 10), per-head
# tasks (small batch) and per-request tasks (batch 32)
SHAPES = [(32, 9, 3, 64), (1, 9, 3, 64), (3, 8, 2, 128), (2, 16, 2, 128), (5, 6, 6, 32), (2, 20, 2, 64),
          (9, 4, 4, 64)]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # bf16: the output's own rounding


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{b}h{h}kv{k}d{d}" for b, h, k, d in SHAPES])
def test_kernel_equals_sdpa_over_gathered_pages(shape, page_size, dtype, cpu_tier):
    q, k_pool, v_pool, table, lens = _problem(*shape, page_size, 75, dtype)
    scale = shape[3] ** -0.5
    got = cpu_kernel.paged_decode(q, k_pool, v_pool, table, lens, page_size, scale)
    want = paged_decode_reference(q, k_pool, v_pool, table, lens, page_size, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - want).abs().max() < TOLERANCE[dtype]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_stores_the_new_token_then_attends_to_it(dtype, cpu_tier):
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
    want = paged_decode_reference(q, k_pool, v_pool, table, lens, ps, 0.125)
    assert (got.float() - want).abs().max() < TOLERANCE[dtype]


@needs_compiler
@pytest.mark.parametrize("rows", [3, 12], ids=["per-head-tasks", "per-request-tasks"])
def test_rows_of_one_request_see_each_others_new_tokens(rows, cpu_tier):
    """A checked draft is several rows of one request (one page table, lengths L+1 .. L+R):
    each row attends to the new tokens of the rows before it, so every row's K/V must be stored
    before any row attends. The rows come longest first here, so a kernel that stored each row's
    K/V only as it reached that row would attend to stale slots."""
    heads, kv_heads, dim, ps, prefix = 9, 3, 64, 16, 37
    gen = torch.Generator().manual_seed(5)
    pages = -(-(prefix + rows) // ps)
    k_pool = torch.randn((pages + 2) * ps, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v_pool = torch.randn((pages + 2) * ps, kv_heads, dim, generator=gen).to(torch.bfloat16)
    order = list(range(rows))[::-1]  # row j is the token at position prefix + order[j]
    table = torch.randperm(pages + 2, generator=gen)[:pages].repeat(rows, 1)
    lens = torch.tensor([prefix + i + 1 for i in order])
    q = torch.randn(rows, heads, dim, generator=gen).to(torch.bfloat16)
    k_new = torch.randn(rows, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(rows, kv_heads, dim, generator=gen).to(torch.bfloat16)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    last = lens - 1
    slots = table[0, last // ps] * ps + last % ps
    want_k[slots], want_v[slots] = k_new, v_new
    got = cpu_kernel.paged_decode(q, k_pool, v_pool, table, lens, ps, 0.125, k_new=k_new, v_new=v_new)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)  # each row in its slot, nothing else
    want = paged_decode_reference(q, want_k, want_v, table, lens, ps, 0.125)
    assert (got.float() - want).abs().max() < TOLERANCE[torch.bfloat16]
    again = cpu_kernel.paged_decode(q, want_k, want_v, table, lens, ps, 0.125)  # all already stored
    assert torch.equal(got, again)


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
    """At the portable tier, whose build is the shortest: caching does not depend on the tier."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    cpu_kernel._load_library.cache_clear()
    try:
        assert cpu_kernel.load_library(isa.Tier.PORTABLE) is not None
        built = list((tmp_path / "kernels").glob("radixserve-cpu-portable-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_kernel._load_library.cache_clear()
        assert cpu_kernel.load_library(isa.Tier.PORTABLE) is not None
        assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    finally:
        cpu_kernel._load_library.cache_clear()


def test_loading_the_kernels_keeps_subnormal_floats(tmp_path):
    """-ffast-math at link time would add a constructor that sets flush-to-zero for the whole
    process when the library loads, changing every later float op (tiny values become 0)."""
    import ctypes
    import sys

    tiny = sys.float_info.min / 4  # a subnormal
    cpu_kernel.load_library()
    assert sys.float_info.min / 4 == tiny != 0.0
    assert torch.tensor([sys.float_info.min], dtype=torch.float64).div(4).item() == tiny
    portable = tmp_path / "one.so"  # the build helper on its own, as the tests use it
    cpu_kernel._build(cpu_kernel._compiler(), portable, [cpu_kernel.SOURCE_DIR / "silu_mul.c"])
    ctypes.CDLL(str(portable))
    assert sys.float_info.min / 4 == tiny != 0.0


@pytest.mark.parametrize("cause", ["no_compiler", "build_fails", "disabled"])
def test_without_the_kernel_torch_native_falls_back(tmp_path, monkeypatch, caplog, cause):
    from radixserve.attention.base import AttentionShape
    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.torch_native import TorchNativeBackend

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    if cause == "no_compiler":
        monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    elif cause == "build_fails":
        monkeypatch.setattr(cpu_kernel, "_compiler", lambda: "false")  # a compiler that fails
    else:
        monkeypatch.setenv("RADIXSERVE_DISABLE_CPU_KERNELS", "1")
    cpu_kernel._load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="radixserve.kernels"):
            backend = TorchNativeBackend(KVPool(1, 8, 4, 2, 64, torch.float32), AttentionShape(4, 2, 64, 0.125))
        assert not backend.uses_cpu_kernel
        if cause != "disabled":
            assert "gather + SDPA" in caplog.text
    finally:
        cpu_kernel._load_library.cache_clear()


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# one step of the output's own rounding: 2^-23 (fp32) or 2^-7 (bf16) of its magnitude
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def _assert_within_steps(got: torch.Tensor, want: torch.Tensor, steps: float) -> None:
    """Equal but for roundings a different fp32 summation order or exp can flip: a few ulps in
    fp32 (where a row's shared scale is one ulp off, every element of the row is), and in
    bf16, whose coarser rounding absorbs most of that, a rare single step."""
    assert got.dtype == want.dtype and got.shape == want.shape
    step = want.float().abs() * ULP[want.dtype] + 1e-30
    assert ((got.float() - want.float()).abs() <= steps * step).all()
    if want.dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.99


@needs_compiler
@DTYPES
@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (300, 64), (4, 3, 128)])
def test_rms_norm_matches_the_torch_ops(shape, dtype, cpu_tier):
    """RMSNorm in C vs transformers' formula in torch."""
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    xf = x.float()
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    _assert_within_steps(cpu_kernel.rms_norm(x, weight, 1e-5), want, steps=1 if dtype == torch.bfloat16 else 4)


@needs_compiler
@DTYPES
def test_rms_norm_reads_strided_rows(dtype, cpu_tier):
    """q/k norms see per-head views of the fused projection: rows are not contiguous."""
    fused = torch.randn(5, 2 * 64 + 3).to(dtype)
    view = fused[:, :128].view(5, 2, 64)
    weight = torch.ones(64).to(dtype)
    assert torch.equal(cpu_kernel.rms_norm(view, weight, 1e-6), cpu_kernel.rms_norm(view.contiguous(), weight, 1e-6))


@needs_compiler
@DTYPES
@pytest.mark.parametrize("tokens", [1, 32, 700])
def test_rotary_matches_the_torch_ops(tokens, dtype, cpu_tier):
    """bf16: bit-identical; fp32: to the last bit (a fused multiply-add may round once less)."""
    from radixserve.models.config import RopeConfig
    from radixserve.models.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(tokens)
    fused = torch.randn(tokens, 12 * 64 + 5, generator=gen).to(dtype)  # strided heads, as in qkv
    x = fused[:, : 12 * 64].view(tokens, 12, 64)
    cos, sin = RotaryEmbedding(64, RopeConfig())(torch.randint(0, 4000, (tokens,), generator=gen), dtype)
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    want = x * c + torch.cat((-x2, x1), dim=-1) * s
    got = cpu_kernel.rotary(x, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # x*cos and x*sin are of the size of x: one ulp of x bounds each rounding
        assert got.shape == want.shape and ((got - want).abs() <= 2 * ULP[dtype] * x.abs().amax(-1, keepdim=True)).all()


@needs_compiler
@DTYPES
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_silu_mul_matches_the_torch_ops(tokens, dtype, cpu_tier):
    gen = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    # exp may differ from torch's in its last bit, which can move a bf16 result by one step
    _assert_within_steps(cpu_kernel.silu_mul(gate_up), F.silu(gate) * up, steps=2 if dtype == torch.bfloat16 else 8)


@needs_compiler
@DTYPES
def test_add_rms_norm_is_the_add_then_the_norm(dtype, cpu_tier):
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(2, 32, 576, generator=gen) * 2).to(dtype).unbind(0)
    weight = torch.randn(576, generator=gen).to(dtype)
    total, normed = cpu_kernel.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)  # the add, bit for bit
    assert torch.equal(normed, cpu_kernel.rms_norm(x + residual, weight, 1e-5))
