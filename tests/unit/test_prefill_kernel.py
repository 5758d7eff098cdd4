"""The CPU prefill attention kernel (AVX-512 and AVX2 tiles, bf16 and fp32) against float64 SDPA,
at every ISA tier this machine runs, and where it is used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBatch, AttentionShape
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.kernels import cpu as cpu_kernel
from radixserve.kernels.isa import Tier


def _require_kernel(tier: Tier, dtype: torch.dtype, head_dim: int) -> None:
    """Skip unless the library built for the tier in use serves this dtype and head size."""
    lib = cpu_kernel.load_library()
    if lib is None:
        pytest.skip("no C compiler: the CPU kernels are off")
    if not lib.prefill_attention_supported(head_dim, cpu_kernel.DTYPE_CODES[dtype]):
        pytest.skip(f"the {tier} build of the prefill kernel does not serve {str(dtype)[6:]} at head size {head_dim}")


# bf16: the kernel rounds the probabilities to bf16 before P.V and the output once, like torch's
# bf16 flash attention; both land within ~1e-2 of exact on these unit-variance inputs. fp32: fp32
# rounding, as torch's fp32 SDPA, up to ~5e-6 from exact at head size 128.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _problem(heads, kv_heads, head_dim, page_size, prefix_len, new_tokens, seed=0, dtype=torch.bfloat16):
    """A shuffled pool holding one request's prefix + new tokens; q as a strided view of a
    fused [q | k] projection, as the model makes it."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = prefix_len + new_tokens
    needed = -(-seq_len // page_size)
    num_pages = needed + 5
    k_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
    pages = torch.randperm(num_pages, generator=gen)[:needed]
    fused = (2 * torch.randn(new_tokens, heads + kv_heads, head_dim, generator=gen)).to(dtype)
    return fused[:, :heads], k_pool, v_pool, pages


def _reference(q, k_pool, v_pool, pages, page_size, prefix_len, scale):
    """SDPA over the gathered context in float64 (exact next to fp32, whatever tier caps torch's
    kernels), new token i seeing positions 0 .. prefix_len + i."""
    seq_len = prefix_len + q.shape[0]
    pos = torch.arange(seq_len)
    slots = pages[pos // page_size] * page_size + pos % page_size
    k = k_pool[slots].double().transpose(0, 1)[None]  # [1, Hkv, S, D]
    v = v_pool[slots].double().transpose(0, 1)[None]
    mask = pos[None, :] <= torch.arange(q.shape[0])[:, None] + prefix_len
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [E, H, D]


# (heads, kv_heads, head_dim, dtype): the default model's GQA (9/3), head size 128, no GQA, G = 8
SHAPES = [(9, 3, 64, torch.bfloat16), (9, 3, 64, torch.float32), (8, 2, 128, torch.bfloat16),
          (8, 2, 128, torch.float32), (4, 4, 64, torch.bfloat16), (16, 2, 64, torch.float32)]
# (prefix, new): one and two new tokens, a tail that fills no key block, page-aligned and
# unaligned prefixes, blocks of 64 exactly, several blocks
LENGTHS = [(0, 1), (0, 2), (0, 77), (3, 64), (100, 17), (64, 64), (0, 300), (250, 130)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{h}kv{k}d{d}-{str(t)[6:]}" for h, k, d, t in SHAPES])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"p{p}e{e}" for p, e in LENGTHS])
def test_kernel_equals_causal_sdpa_over_gathered_pages(cpu_tier, shape, page_size, lengths):
    heads, kv_heads, head_dim, dtype = shape
    _require_kernel(cpu_tier, dtype, head_dim)
    prefix_len, new_tokens = lengths
    q, k_pool, v_pool, pages = _problem(heads, kv_heads, head_dim, page_size, prefix_len, new_tokens, dtype=dtype)
    scale = head_dim**-0.5
    out = torch.full((new_tokens, heads, head_dim), float("nan"), dtype=dtype)
    cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, page_size, prefix_len, scale, out)
    want = _reference(q, k_pool, v_pool, pages, page_size, prefix_len, scale)
    assert (out.double() - want).abs().max() < TOLERANCE[dtype]


def test_kernel_writes_only_its_rows_of_a_larger_output(cpu_tier):
    """The backend hands each prefill chunk its slice of the batch's output."""
    _require_kernel(cpu_tier, torch.bfloat16, 64)
    q, k_pool, v_pool, pages = _problem(9, 3, 64, 16, 20, 40, seed=4)
    whole = torch.zeros(100, 9, 64, dtype=torch.bfloat16)
    cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, 16, 20, 0.125, whole[30:70])
    assert whole[:30].eq(0).all() and whole[70:].eq(0).all()
    want = _reference(q, k_pool, v_pool, pages, 16, 20, 0.125)
    assert (whole[30:70].double() - want).abs().max() < TOLERANCE[torch.bfloat16]


def test_kernel_rejects_what_it_cannot_serve(cpu_tier):
    _require_kernel(cpu_tier, torch.bfloat16, 64)
    q, k_pool, v_pool, pages = _problem(9, 3, 64, 16, 0, 40)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot hold"):
        cpu_kernel.prefill_attention(q, k_pool, v_pool, pages[:2], 16, 0, 0.1, out)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernel.prefill_attention(q[:, :8], k_pool, v_pool, pages, 16, 0, 0.1, torch.empty(40, 8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernel.prefill_attention(q, k_pool, v_pool, pages, 16, 0, 0.1, out.transpose(0, 1))
    with pytest.raises(ValueError, match="bfloat16 with head size 32"):
        small = torch.empty(40, 9, 32, dtype=torch.bfloat16)
        cpu_kernel.prefill_attention(small, k_pool[..., :32].contiguous(), v_pool[..., :32].contiguous(), pages, 16, 0, 0.1, small.clone())
    with pytest.raises(ValueError, match="float32 with head size 80"):
        big = torch.empty(40, 8, 80)
        pool = torch.empty(k_pool.shape[0], 2, 80)
        cpu_kernel.prefill_attention(big, pool, pool, pages, 16, 0, 0.1, big.clone())


# Where the kernel serves, per tier: the (dtype, head size) pairs where it beats torch's flash
# attention on a CPU of that tier (prefill_attention.c, `tile_serves`). On AMX CPUs torch's
# flash attention runs its bf16 matmuls on AMX tiles, and bf16 stays with torch.
SERVES = {
    Tier.PORTABLE: set(),
    Tier.AVX2: {(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 128), (torch.bfloat16, 128)},
    Tier.AVX512: {(torch.float32, 64), (torch.bfloat16, 64)},
    Tier.AVX512_BF16: {(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 128)},
    Tier.AMX: {(torch.float32, 64)},
}


def test_where_the_kernel_serves(cpu_tier):
    cpu = torch.device("cpu")
    want = SERVES[cpu_tier] if cpu_kernel.load_library() is not None else set()
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 80, 128):
            assert cpu_kernel.prefill_attention_serves(dtype, head_dim, cpu) == ((dtype, head_dim) in want), (dtype, head_dim)
    assert not cpu_kernel.prefill_attention_serves(torch.float16, 64, cpu)
    assert not cpu_kernel.prefill_attention_serves(torch.float32, 64, torch.device("meta"))


def test_bf16_stays_with_torch_where_it_owns_bf16_matmuls(cpu_tier, monkeypatch):
    """On AMX CPUs torch's flash attention runs its bf16 matmuls on AMX tiles."""
    monkeypatch.setattr(cpu_kernel, "torch_owns_bf16_matmuls", lambda: True)
    cpu = torch.device("cpu")
    assert not any(cpu_kernel.prefill_attention_serves(torch.bfloat16, d, cpu) for d in (64, 128))
    fp32_served = cpu_kernel.load_library() is not None and (torch.float32, 64) in SERVES[cpu_tier]
    assert cpu_kernel.prefill_attention_serves(torch.float32, 64, cpu) == fp32_served


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_with_the_kernel_equals_sdpa_on_a_mixed_batch(cpu_tier, page_size, dtype, monkeypatch):
    """Prefill chunks with and without a cached prefix next to decode rows, through
    TorchNativeBackend with the kernels and with SDPA only: the same attention."""
    _require_kernel(cpu_tier, dtype, 64)
    monkeypatch.setattr(cpu_kernel, "torch_owns_bf16_matmuls", lambda: False)  # as on a CPU without AMX
    shape = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, scale=0.125)
    prefix_lens, extend_lens = [0, 37, 80, 16], [50, 1, 23, 1]
    gen = torch.Generator().manual_seed(7)
    per_row = -(-max(p + e for p, e in zip(prefix_lens, extend_lens)) // page_size)
    outputs = []
    for use_kernels in (True, False):
        pool = KVPool(1, 4 * per_row + 8, page_size, 3, 64, dtype)
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=torch.Generator().manual_seed(1)))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=torch.Generator().manual_seed(2)))
        backend = TorchNativeBackend(pool, shape, use_cpu_kernel=use_kernels)
        assert backend.uses_prefill_kernel == use_kernels
        table = torch.randperm(pool.num_pages, generator=torch.Generator().manual_seed(3))[: 4 * per_row].view(4, per_row)
        backend.plan(AttentionBatch(page_size, table, prefix_lens, extend_lens))
        tokens = sum(extend_lens)
        gen.manual_seed(5)
        q = torch.randn(tokens, 9, 64, generator=gen).to(dtype)
        k = torch.randn(tokens, 3, 64, generator=gen).to(dtype)
        v = torch.randn(tokens, 3, 64, generator=gen).to(dtype)
        outputs.append(backend.forward(q, k, v, 0).float())
    assert (outputs[0] - outputs[1]).abs().max() < TOLERANCE[dtype]
