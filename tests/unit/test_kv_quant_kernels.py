"""The CPU attention kernels over quantized KV pools (fp8_e4m3, fp8_e5m2, int8 with its scales;
and fp32 / bf16 pools under queries of the other dtype), read in place: against attention over
the pool as kv_quant.dequantize gives it, at every ISA tier this machine runs (`cpu_tier`:
portable and the machine's, each kernel build).

Tolerances, relative to the largest |output| of the call (outputs are weighted means of V rows,
so that is V's scale):
- fp32 queries: 1e-5. The kernel's products and sums are fp32 (int8's scale applied to the q.k
  sum and to the weight instead of to each element); only fp32 rounding order differs from the
  reference, a few 1e-7 here. A misread element or scale moves the output by far more.
- bf16 queries: the bf16 kernel's own tolerance: the output is rounded once to bf16 (2^-8
  relative to each element), plus 1e-5 as for fp32 (the prefill kernel also rounds its softmax
  weights to bf16 before P.V, as torch's bf16 attention does: 2^-8 of each weight, so 1e-2
  there, as in test_prefill_kernel.py; so does the decode kernel's AVX-512 BF16 path, which
  serves bf16 queries over a bf16 pool from that tier up).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from attention_reference import paged_decode_reference

from radixserve.kernels import cpu as cpu_kernel
from radixserve.kernels import kv_quant
from radixserve.kernels.isa import Tier
from radixserve.kernels.kv_quant import FORMATS, KVFormat

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
ALL_FORMATS = [*QUANTIZED, "bfloat16", "float32"]
COMPUTE = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
RELATIVE = 1e-5


def _require_library() -> None:
    if cpu_kernel.load_library() is None:
        pytest.skip("the CPU kernels are off here")


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, weights_rounded: bool = False) -> None:
    """got (the kernel's, in `dtype`) against the fp32/fp64 reference: see the module docstring."""
    assert got.dtype == dtype and got.shape == want.shape
    want = want.double()
    scale = want.abs().max().clamp(min=1e-300)
    allowed = RELATIVE * scale
    if dtype == torch.bfloat16:
        allowed = allowed + want.abs() * 2.0**-8 + (1e-2 * scale if weights_rounded else 0)
    err = (got.double() - want).abs()
    assert (err <= allowed).all(), f"max error {float((err / scale).max()):.3g} of the output's scale"


def _store(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [slots, Hkv, D] as a pool of `fmt`: (data, scales or None, what the data holds, fp32)."""
    data, scales = kv_quant.quantize(x, fmt)
    return data, scales, kv_quant.dequantize(data, scales, fmt)


# Magnitude bands of the stored K and V (the queries scaled inversely, so scores stay O(1)):
# "normal" spans the formats' ordinary range; "tiny" puts most fp8 values on subnormals (e4m3
# below 2^-6, e5m2 below 2^-14) and int8 scales on fp16 subnormals; "huge" reaches past the
# fp8 saturation limits (448, 57344) and, for int8, past the largest fp16 scale (so values
# saturate at +-127 steps of 65504).
BANDS = {
    "normal": {"fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "int8": 1.0, "bfloat16": 1.0, "float32": 1.0},
    "tiny": {"fp8_e4m3": 2.0**-8, "fp8_e5m2": 2.0**-15, "int8": 2.0**-12},
    "huge": {"fp8_e4m3": 300.0, "fp8_e5m2": 4e4, "int8": 1e7},
}


def _values(shape: tuple[int, ...], magnitude: float, gen: torch.Generator, spread: bool) -> torch.Tensor:
    """Normal values of about `magnitude`; with `spread`, each (slot, head) row scaled by its own
    factor in [1/8, 8] (int8's scales then differ per token and per kv head)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if spread:
        x = x * torch.exp2(torch.empty(shape[:-1] + (1,), dtype=torch.float64).uniform_(-3, 3, generator=gen))
    return (x * magnitude).float()


def _decode_problem(batch, heads, kv_heads, head_dim, page_size, max_len, dtype, fmt, magnitude=1.0, seed=0):
    """Pools of `fmt` on shuffled pages, lengths up to max_len (the first max_len, the others
    random: mostly not page multiples), queries of `dtype` scaled by 1 / magnitude."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = -(-max_len // page_size)
    num_pages = batch * pages_per_row + 3
    slots = num_pages * page_size
    k, ks, k_ref = _store(_values((slots, kv_heads, head_dim), magnitude, gen, fmt.scaled), fmt)
    v, vs, v_ref = _store(_values((slots, kv_heads, head_dim), magnitude, gen, fmt.scaled), fmt)
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_row].view(batch, -1)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    q = (torch.randn(batch, heads, head_dim, generator=gen) / magnitude).to(dtype)
    return q, (k, ks, k_ref), (v, vs, v_ref), table, lens


def _decode(q, k, v, table, lens, page_size, scale, fmt):
    return cpu_kernel.paged_decode(q, k[0], v[0], table, lens, page_size, scale, kv_format=fmt,
                                   k_scales=k[1], v_scales=v[1])


# (batch, heads, kv_heads, head_dim): the register paths (head size 64 and 128) and the portable
# loop (40, on every tier), each at GQA group sizes 3 and 1; batch 9 gives per-request tasks
# (B >= 4 x threads on this machine's 2 threads), the others per-head tasks
SHAPES = [(5, 9, 3, 64), (9, 9, 3, 64), (3, 4, 4, 64), (4, 6, 2, 128), (2, 2, 2, 128), (3, 6, 2, 40), (2, 3, 3, 40)]


@COMPUTE
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{b}h{h}kv{k}d{d}" for b, h, k, d in SHAPES])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_decode_equals_attention_over_the_dequantized_pool(cpu_tier, name, shape, page_size, dtype):
    _require_library()
    fmt = FORMATS[name]
    assert cpu_kernel.supports_kv(dtype, fmt, torch.device("cpu"))
    q, k, v, table, lens = _decode_problem(*shape, page_size, 75, dtype, fmt, seed=shape[0] + page_size)
    scale = shape[3] ** -0.5
    got = _decode(q, k, v, table, lens, page_size, scale, fmt)
    bf16_dot = dtype == torch.bfloat16 and name == "bfloat16" and cpu_tier >= Tier.AVX512_BF16
    _assert_close(got, paged_decode_reference(q, k[2], v[2], table, lens, page_size, scale, torch.float64), dtype, weights_rounded=bf16_dot)


@COMPUTE
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("shape", [(5, 9, 3, 64), (3, 6, 2, 128), (3, 6, 2, 40)], ids=["d64", "d128", "d40"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_reads_every_magnitude_of_the_format(cpu_tier, name, shape, band, dtype):
    """Subnormal fp8 and fp16 scales, saturated fp8 and clamped int8 scales, decoded exactly:
    the queries are scaled to keep scores O(1), so a misdecoded key moves the softmax."""
    _require_library()
    fmt = FORMATS[name]
    magnitude = BANDS[band][name]
    q, k, v, table, lens = _decode_problem(*shape, 16, 50, dtype, fmt, magnitude, seed=7)
    if band == "tiny":  # the band is what it says
        stored = k[0].view(torch.uint8) if not fmt.scaled else k[1].view(torch.int16)
        exponent = (stored >> (3 if name == "fp8_e4m3" else 2 if name == "fp8_e5m2" else 10)) & (
            0xF if name == "fp8_e4m3" else 0x1F)
        assert (exponent == 0).float().mean() > (0.5 if not fmt.scaled else 0.9)
    scale = shape[3] ** -0.5
    got = _decode(q, k, v, table, lens, 16, scale, fmt)
    _assert_close(got, paged_decode_reference(q, k[2], v[2], table, lens, 16, scale, torch.float64), dtype)


def _every_code(fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every byte the quantizer can store (fp8: all but NaN and infinity; int8: -127 .. 127),
    each once, and int8 scales from fp16's smallest subnormal to its largest value."""
    if fmt.scaled:
        data = torch.arange(-127, 128, dtype=torch.int16).to(torch.int8)
        scales = torch.tensor([2.0**-24, 2.0**-20, 6.1e-5, 1 / 127, 0.37, 1.0, 3.0, 1000.0, 65504.0]).half()
        return data, scales
    data = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    return data[data.view(fmt.storage).float().isfinite()], None  # bytes: viewed as fmt.storage by the caller


@COMPUTE
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_of_one_position_returns_its_value_row_exactly(cpu_tier, name, head_dim, dtype):
    """With a context of one position the output is that V row (weight exp(0) = 1): every code
    of the format, and every int8 scale, must come out as kv_quant.dequantize's value (in bf16:
    that value rounded once)."""
    _require_library()
    fmt = FORMATS[name]
    codes, scale_values = _every_code(fmt)
    rows = -(-codes.numel() // head_dim) * (1 if scale_values is None else scale_values.numel())
    data = codes.repeat(rows * head_dim // codes.numel() + 1)[: rows * head_dim].view(rows, 1, head_dim)
    data = data.view(fmt.storage)
    scales = None if scale_values is None else scale_values.repeat_interleave(rows // scale_values.numel())[:, None]
    k = (torch.zeros(data.shape, dtype=torch.int8).view(fmt.storage), None if scales is None else torch.ones_like(scales))
    v = (data, scales)
    table = torch.arange(rows)[:, None]  # page size 1: request b's context is slot b
    q = torch.randn(rows, 2, head_dim).to(dtype)
    got = cpu_kernel.paged_decode(q, k[0], v[0], table, torch.ones(rows, dtype=torch.int64), 1, 0.125,
                                  kv_format=fmt, k_scales=k[1], v_scales=v[1])
    want = kv_quant.dequantize(data, scales, fmt).expand(rows, 2, head_dim).to(dtype)
    assert torch.equal(got, want)


@COMPUTE
def test_decode_over_a_pool_of_the_compute_dtype_is_unchanged_by_naming_its_format(cpu_tier, dtype):
    """kv_format = the queries' own dtype is today's call, bit for bit."""
    _require_library()
    fmt = FORMATS["bfloat16" if dtype == torch.bfloat16 else "float32"]
    q, k, v, table, lens = _decode_problem(9, 9, 3, 64, 16, 60, dtype, fmt)
    plain = cpu_kernel.paged_decode(q, k[0], v[0], table, lens, 16, 0.125)
    assert torch.equal(_decode(q, k, v, table, lens, 16, 0.125, fmt), plain)
    assert torch.equal(_decode(q, k, v, table, lens, 16, 0.125, fmt.name), plain)  # by name


# ------------------------------------------------------------------------------------- prefill


def _prefill_problem(heads, kv_heads, head_dim, page_size, seq_len, new_tokens, dtype, fmt, seed=0):
    """A shuffled pool of `fmt` holding one request's seq_len positions; q as a strided view of
    a fused projection, as the model makes it."""
    gen = torch.Generator().manual_seed(seed)
    needed = -(-seq_len // page_size)
    num_pages = needed + 5
    slots = num_pages * page_size
    k = _store(_values((slots, kv_heads, head_dim), 1.0, gen, fmt.scaled), fmt)
    v = _store(_values((slots, kv_heads, head_dim), 1.0, gen, fmt.scaled), fmt)
    pages = torch.randperm(num_pages, generator=gen)[:needed]
    fused = (2 * torch.randn(new_tokens, heads + kv_heads, head_dim, generator=gen)).to(dtype)
    return fused[:, :heads], k, v, pages


def _prefill_reference(q, k_ref, v_ref, pages, page_size, positions, scale):
    """SDPA in float64 over the gathered, dequantized context, the token at position p seeing
    positions 0 .. p."""
    seq_len = int(positions[-1]) + 1
    pos = torch.arange(seq_len)
    slots = pages[pos // page_size] * page_size + pos % page_size
    k = k_ref[slots].double().transpose(0, 1)[None]
    v = v_ref[slots].double().transpose(0, 1)[None]
    mask = pos[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _require_prefill(tier: Tier, dtype: torch.dtype, head_dim: int, fmt: KVFormat) -> None:
    _require_library()
    if not cpu_kernel.prefill_attention_serves(dtype, head_dim, torch.device("cpu"), fmt):
        pytest.skip(f"the {tier} build of the prefill kernel does not serve {str(dtype)[6:]} over {fmt.name} "
                    f"at head size {head_dim}")


# (heads, kv_heads, head_dim): the default model's GQA 9/3, no GQA, head size 128 at G = 3
PREFILL_SHAPES = [(9, 3, 64), (4, 4, 64), (6, 2, 128)]
# (prefix, new): a tail that fills no key block, an unaligned prefix, several blocks
PREFILL_LENGTHS = [(0, 77), (100, 17), (250, 130)]


@COMPUTE
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lengths", PREFILL_LENGTHS, ids=[f"p{p}e{e}" for p, e in PREFILL_LENGTHS])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=[f"h{h}kv{k}d{d}" for h, k, d in PREFILL_SHAPES])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_prefill_equals_attention_over_the_dequantized_pool(cpu_tier, name, shape, lengths, page_size, dtype):
    heads, kv_heads, head_dim = shape
    fmt = FORMATS[name]
    _require_prefill(cpu_tier, dtype, head_dim, fmt)
    prefix, new = lengths
    q, k, v, pages = _prefill_problem(heads, kv_heads, head_dim, page_size, prefix + new, new, dtype, fmt,
                                      seed=prefix + page_size)
    out = torch.full((new, heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    cpu_kernel.prefill_attention(q, k[0], v[0], pages, page_size, prefix, scale, out, kv_format=fmt,
                                 k_scales=k[1], v_scales=v[1])
    want = _prefill_reference(q, k[2], v[2], pages, page_size, torch.arange(prefix, prefix + new), scale)
    _assert_close(out, want, dtype, weights_rounded=True)


@COMPUTE
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", QUANTIZED)
def test_prefill_with_scattered_positions(cpu_tier, name, head_dim, dtype):
    """A selective recompute's queries at scattered positions over a quantized pool."""
    fmt = FORMATS[name]
    _require_prefill(cpu_tier, dtype, head_dim, fmt)
    seq_len, new = 200, 37
    q, k, v, pages = _prefill_problem(9, 3, head_dim, 16, seq_len, new, dtype, fmt, seed=3)
    gen = torch.Generator().manual_seed(4)
    positions = torch.cat([torch.randperm(seq_len - 1, generator=gen)[: new - 1].sort().values,
                           torch.tensor([seq_len - 1])])
    out = torch.full((new, 9, head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    cpu_kernel.prefill_attention(q, k[0], v[0], pages, 16, 3, scale, out, positions=positions, kv_format=fmt,
                                 k_scales=k[1], v_scales=v[1])
    _assert_close(out, _prefill_reference(q, k[2], v[2], pages, 16, positions, scale), dtype, weights_rounded=True)


# Where prefill serves a pool of another format than the queries' (8-bit, or mixed), per tier:
# the pool is packed into fp32 words and served where the fp32-word tile is (prefill_attention.c,
# `tile_serves`); bf16 queries never on the AMX tier.
SERVES_OTHER = {
    Tier.PORTABLE: set(),
    Tier.AVX2: {(d, h) for d in (torch.float32, torch.bfloat16) for h in (64, 128)},
    Tier.AVX512: {(torch.float32, 64), (torch.bfloat16, 64)},
    Tier.AVX512_BF16: {(torch.float32, 64), (torch.bfloat16, 64)},
    Tier.AMX: {(torch.float32, 64)},
}


def test_where_the_kernels_serve_each_format(cpu_tier):
    cpu = torch.device("cpu")
    lib = cpu_kernel.load_library()
    for dtype in (torch.float32, torch.bfloat16):
        for name in ALL_FORMATS:
            fmt = FORMATS[name]
            assert cpu_kernel.supports_kv(dtype, fmt, cpu) == (lib is not None)  # decode: every format
            if fmt.storage == dtype:  # the pool of the compute dtype: as before
                for head_dim in (64, 80, 128):
                    assert cpu_kernel.prefill_attention_serves(dtype, head_dim, cpu, fmt) == \
                        cpu_kernel.prefill_attention_serves(dtype, head_dim, cpu)
                continue
            want = SERVES_OTHER[cpu_tier] if lib is not None else set()
            for head_dim in (64, 80, 128):
                assert cpu_kernel.prefill_attention_serves(dtype, head_dim, cpu, fmt) == ((dtype, head_dim) in want), \
                    (dtype, name, head_dim)
    float16 = kv_quant.kv_format("auto", torch.float16)  # the CUDA backend's only
    assert not cpu_kernel.supports_kv(torch.float32, float16, cpu)
    assert not cpu_kernel.prefill_attention_serves(torch.float32, 64, cpu, float16)
    assert not cpu_kernel.supports_kv(torch.float16, FORMATS["int8"], cpu)
    assert not cpu_kernel.supports_kv(torch.float32, FORMATS["int8"], torch.device("meta"))
    assert cpu_kernel.supports_kv(torch.float32, None, cpu) == cpu_kernel.supports(torch.float32, cpu)


# ------------------------------------------------------------------------------- wrong calls


def _int8_pools(slots: int = 32, kv_heads: int = 2, head_dim: int = 64):
    fmt = FORMATS["int8"]
    k, ks = kv_quant.quantize(torch.randn(slots, kv_heads, head_dim), fmt)
    v, vs = kv_quant.quantize(torch.randn(slots, kv_heads, head_dim), fmt)
    return fmt, k, v, ks, vs


def test_decode_refuses_wrong_calls():
    _require_library()
    fmt, k, v, ks, vs = _int8_pools()
    q, table, lens = torch.randn(2, 4, 64), torch.tensor([[0, 1], [1, 0]]), torch.tensor([20, 9])
    call = dict(kv_format=fmt, k_scales=ks, v_scales=vs)
    cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, **call)  # the right call
    with pytest.raises(ValueError, match="takes no k_new"):
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, k[:2], v[:2], **call)
    e4m3 = FORMATS["fp8_e4m3"]
    k8, v8 = kv_quant.quantize(torch.randn(32, 2, 64), e4m3)[0], kv_quant.quantize(torch.randn(32, 2, 64), e4m3)[0]
    with pytest.raises(ValueError, match="takes no k_new"):
        cpu_kernel.paged_decode(q, k8, v8, table, lens, 16, 0.1, k8[:2], v8[:2], kv_format=e4m3)
    with pytest.raises(ValueError, match="needs k_scales and v_scales"):
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, kv_format=fmt, k_scales=ks)
    with pytest.raises(ValueError, match="needs k_scales and v_scales"):
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, kv_format=fmt)
    for bad in (ks.float(), ks[:-1], ks.t().contiguous(), ks[:, :1], ks.repeat(1, 2)[:, ::2]):
        with pytest.raises(ValueError, match="k_scales must be a contiguous"):
            cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, kv_format=fmt, k_scales=bad, v_scales=vs)
    with pytest.raises(ValueError, match="v_scales must be a contiguous"):
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, kv_format=fmt, k_scales=ks, v_scales=vs.float())
    with pytest.raises(ValueError, match="for int8 KV pools only"):
        cpu_kernel.paged_decode(q, k8, v8, table, lens, 16, 0.1, kv_format=e4m3, k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="holds torch.float8_e4m3fn"):  # the bytes of another format
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, kv_format=e4m3)
    with pytest.raises(ValueError, match="without kv_format the KV pool must be torch.float32"):  # q's dtype
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1)
    with pytest.raises(ValueError, match="unknown KV format"):
        cpu_kernel.paged_decode(q, k, v, table, lens, 16, 0.1, kv_format="int4")
    with pytest.raises(ValueError, match="queries must be"):
        cpu_kernel.paged_decode(q.half(), k, v, table, lens, 16, 0.1, **call)
    bf16 = FORMATS["bfloat16"]  # an unquantized pool of another dtype takes new rows of its own dtype
    kb, vb = torch.randn(32, 2, 64).bfloat16(), torch.randn(32, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="new K/V must be torch.bfloat16"):
        cpu_kernel.paged_decode(q, kb, vb, table, lens, 16, 0.1, q[:, :2], q[:, :2], kv_format=bf16)


def test_prefill_refuses_wrong_calls(cpu_tier):
    fmt, k, v, ks, vs = _int8_pools()
    _require_prefill(cpu_tier, torch.float32, 64, fmt)
    q, out, pages = torch.randn(10, 4, 64), torch.empty(10, 4, 64), torch.arange(2)
    cpu_kernel.prefill_attention(q, k, v, pages, 16, 5, 0.1, out, kv_format=fmt, k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="needs k_scales and v_scales"):
        cpu_kernel.prefill_attention(q, k, v, pages, 16, 5, 0.1, out, kv_format=fmt, v_scales=vs)
    with pytest.raises(ValueError, match="k_scales must be a contiguous"):
        cpu_kernel.prefill_attention(q, k, v, pages, 16, 5, 0.1, out, kv_format=fmt, k_scales=ks.float(), v_scales=vs)
    with pytest.raises(ValueError, match="holds torch.int8"):
        cpu_kernel.prefill_attention(q, k.view(torch.float8_e5m2), v, pages, 16, 5, 0.1, out, kv_format=fmt,
                                     k_scales=ks, v_scales=vs)
    with pytest.raises(ValueError, match="out must be torch.float32"):
        cpu_kernel.prefill_attention(q, k, v, pages, 16, 5, 0.1, out.bfloat16(), kv_format=fmt, k_scales=ks,
                                     v_scales=vs)
    with pytest.raises(ValueError, match="float32 with head size 32 over a KV pool of int8"):
        small_fmt, k32, v32, ks32, vs32 = _int8_pools(head_dim=32)
        cpu_kernel.prefill_attention(q[..., :32].contiguous(), k32, v32, pages, 16, 5, 0.1, out[..., :32].contiguous(),
                                     kv_format=small_fmt, k_scales=ks32, v_scales=vs32)
