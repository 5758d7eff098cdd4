"""Linear layers over GGUF-quantized blocks (radixserve/kernels/quant_linear.py), on the build of
every ISA tier this machine runs (`cpu_tier`), for every served format (Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K).

Two references, both in float64:

- The kernel's own arithmetic (`_integer_reference`): the activations quantized as the kernel
  quantizes them (blocks of 32 or 256, d = max|x| * fp32(1/127), values rint(x / d) in fp32;
  for Q8_0 int16, d = max|x| * fp32(1/32767)), exact integer dot products per weight block,
  each scaled by the fp32 product d_w * d_x (and Q4_1's m_w * d_x * sum(q), Q4_K's mins). The
  kernel may differ from it only by its fp32 rounding (the order of the block sums, each lane's
  scaled partial sum): the tolerance is the worst-case bound of recursive fp32 summation,
  (blocks + 32) * 2^-24 times the sum of the absolute values of the terms (the 32 covers the
  per-lane products and the vector reduction), plus half a bf16 step of the value for bf16
  outputs. A misread block, scale or min moves an output by about one term, far more than that.
- Plain dequantize-then-matmul (`dequantize`, gguf's numpy dequantization): the kernel's
  activations are rounded to int8 per block, as llama.cpp's are, so it is not that. Tolerance:
  the relative error in Frobenius norm over the whole [M, N] output, per format, measured on
  these random problems (normal activations, per-format random weights; 16 problems per
  format) with a margin of about 2x: Q4_0, Q4_1 0.012 (measured 0.0048 to 0.0057: the int8
  rounding of the activations, up to max|x| / 254 per value in blocks of 32); Q4_K, Q6_K 0.016
  (measured 0.0058 to 0.0084: blocks of 256 have a larger max|x|, so a coarser step); Q8_0
  5e-5 (measured 1.9e-5 to 2.2e-5: its activations are int16). The largest single error is
  bounded by 8x the RMS one (measured up to 5.9x).

Rows alone and in a batch give bit-identical outputs, whatever the thread count; the portable
build agrees with the tier in use within the fp32-order tolerance.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa
from radixserve.kernels.quant_linear import (
    QUANT_TYPES,
    QuantType,
    dequantize,
    dequantize_to,
    pack_quantized,
    quant_linear,
    quant_linear_serves,
    quant_type_of,
    row_bytes,
    unpack_quantized,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")

NAMES = list(QUANT_TYPES)
MATMUL_TOLERANCE = {"Q8_0": 5e-5, "Q4_0": 0.012, "Q4_1": 0.012, "Q4_K": 0.016, "Q6_K": 0.016}
ROWS = (1, 3, 17)
COLUMNS = (1, 7, 33, 130)
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def _in_features(qtype: QuantType) -> tuple[int, int]:
    return (32, 96) if qtype.block_size == 32 else (256, 768)


def _require_library() -> None:
    if cpu_kernels.load_library() is None:
        pytest.skip("the CPU kernels are off here")


# ---------------------------------------------------------------------------- problems


def _blocks(qtype: QuantType, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random valid weights of `qtype`, uint8 [n, k / block * bytes]: gguf's quantizer for the
    32-blocks (weights with a random offset per row, so Q4_1's mins matter); for the K-quants,
    which gguf cannot quantize, random bytes with small positive fp16 d (and dmin)."""
    if qtype.block_size == 32:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05 + rng.standard_normal((n, 1)).astype(np.float32) * 0.02
        data = gguf_quantize(w, GGMLQuantizationType(qtype.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(data)).view(n, -1)
    blocks = rng.integers(0, 256, size=(n, k // 256, qtype.block_bytes), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, size=(n, k // 256, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype.name == "Q4_K":
        blocks[..., 0:4] = scales.reshape(n, k // 256, 4)
    else:
        blocks[..., 208:210] = scales[..., :2]
    return torch.from_numpy(blocks.reshape(n, -1).copy())


def _activations(m: int, k: int, dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)


# ---------------------------------------------------------------------------- the integer reference


def _quantize_rows(x: np.ndarray, block: int, top: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """As the kernel: (q int64 [M, blocks, block], d float32 [M, blocks]); values within +-top
    (127, or Q8_0's int16 32767)."""
    m, k = x.shape
    v = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(v).max(axis=-1)
    d = (amax * (np.float32(1.0) / np.float32(top))).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint((v * inverse[..., None]).astype(np.float32)).astype(np.int64)
    return q, d


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _decode(blocks: torch.Tensor, qtype: QuantType, k: int) -> dict[str, np.ndarray]:
    """The weight blocks' integers and scales, [N, blocks, ...]: `q` (the integer values: Q4_0
    less its 8, Q6_K less its 32), `d`, and Q4_1's `m`, the K-quants' sub-block `sc`, Q4_K's `mn`
    and `dmin`."""
    raw = blocks.numpy().reshape(blocks.shape[0], k // qtype.block_size, qtype.block_bytes)
    name = qtype.name
    if name == "Q8_0":
        return {"q": raw[..., 2:].view(np.int8).astype(np.int64), "d": _fp16(raw[..., 0:2])}
    if name in ("Q4_0", "Q4_1"):
        start = 2 if name == "Q4_0" else 4
        nib = raw[..., start:start + 16].astype(np.int64)
        q = np.concatenate([nib & 0xF, nib >> 4], axis=-1) - (8 if name == "Q4_0" else 0)
        out = {"q": q, "d": _fp16(raw[..., 0:2])}
        if name == "Q4_1":
            out["m"] = _fp16(raw[..., 2:4])
        return out
    if name == "Q4_K":
        s = raw[..., 4:16].astype(np.int64)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = raw[..., 16:144].astype(np.int64).reshape(*raw.shape[:2], 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*raw.shape[:2], 256)
        return {"q": q, "d": _fp16(raw[..., 0:2]), "dmin": _fp16(raw[..., 2:4]), "sc": sc, "mn": mn}
    ql = raw[..., 0:128].astype(np.int64).reshape(*raw.shape[:2], 2, 64)
    qh = raw[..., 128:192].astype(np.int64).reshape(*raw.shape[:2], 2, 32)
    lo, hi = ql[..., :32], ql[..., 32:]
    q = np.stack([(lo & 0xF) | (qh & 3) << 4, (hi & 0xF) | ((qh >> 2) & 3) << 4,
                  (lo >> 4) | ((qh >> 4) & 3) << 4, (hi >> 4) | ((qh >> 6) & 3) << 4], axis=-2)
    return {"q": q.reshape(*raw.shape[:2], 256) - 32, "d": _fp16(raw[..., 208:210]),
            "sc": raw[..., 192:208].view(np.int8).astype(np.int64)}


def _integer_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: QuantType, bias: torch.Tensor | None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's arithmetic in float64: (y [M, N], the sum of |terms| per output)."""
    k = x.shape[1]
    w = _decode(blocks, qtype, k)
    xq, dx = _quantize_rows(x.float().numpy(), qtype.block_size, 32767 if qtype.name == "Q8_0" else 127)
    scale = (w["d"][None, :, :] * dx[:, None, :]).astype(np.float32).astype(np.float64)  # [M, N, blocks]
    if qtype.block_size == 32:
        dots = np.einsum("nbe,mbe->mnb", w["q"], xq)
        mags = np.einsum("nbe,mbe->mnb", np.abs(w["q"]), np.abs(xq))
        y = (scale * dots).sum(-1)
        mag = (np.abs(scale) * mags).sum(-1)
        if qtype.name == "Q4_1":
            sx = (dx * xq.sum(-1).astype(np.float32)).astype(np.float32).astype(np.float64)  # [M, blocks]
            mins = w["m"][None].astype(np.float64) * sx[:, None, :]
            y, mag = y + mins.sum(-1), mag + np.abs(mins).sum(-1)
    else:
        sub = 32 if qtype.name == "Q4_K" else 16
        nsub = 256 // sub
        wq = w["q"].reshape(*w["q"].shape[:2], nsub, sub)
        xs = xq.reshape(*xq.shape[:2], nsub, sub)
        dots = np.einsum("nbse,mbse->mnbs", wq, xs)
        unsigned = np.abs(wq) if qtype.name == "Q4_K" else wq + 32  # Q6_K's lanes hold q + 32 and the offset
        mags = np.einsum("nbse,mbse->mnbs", unsigned, np.abs(xs))
        if qtype.name == "Q6_K":
            mags = mags + 32 * np.abs(xs.sum(-1))[:, None]
        y = (scale * (dots * w["sc"][None]).sum(-1)).sum(-1)
        mag = (np.abs(scale) * (mags * np.abs(w["sc"][None])).sum(-1)).sum(-1)
        if qtype.name == "Q4_K":
            min_scale = (w["dmin"][None, :, :] * dx[:, None, :]).astype(np.float32).astype(np.float64)
            summ = np.einsum("nbs,mbs->mnb", w["mn"], xs.sum(-1))
            y = y - (min_scale * summ).sum(-1)
            mag = mag + (np.abs(min_scale) * np.abs(summ)).sum(-1)
    if bias is not None:
        b = bias.double().numpy()[None]
        y, mag = y + b, mag + np.abs(b)
    return y, mag


def _assert_fp32_order_close(got: torch.Tensor, want: np.ndarray, magnitude: np.ndarray, blocks: int) -> None:
    err = np.abs(got.double().numpy() - want)
    allowed = (blocks + 32) * 2.0**-24 * magnitude + 1e-30
    if got.dtype == torch.bfloat16:
        allowed = allowed + 2.0**-8 * np.abs(want)
    assert (err <= allowed).all(), f"max error {float((err / (magnitude + 1e-30)).max()):.3g} of the terms' magnitude"


# ---------------------------------------------------------------------------- tests


def test_quant_types_match_gguf():
    from gguf.constants import GGML_QUANT_SIZES

    for name, qtype in QUANT_TYPES.items():
        assert GGMLQuantizationType[name].value == qtype.ggml_type
        assert GGML_QUANT_SIZES[GGMLQuantizationType(qtype.ggml_type)] == (qtype.block_size, qtype.block_bytes)
        assert quant_type_of(qtype.ggml_type) is qtype
    assert quant_type_of(GGMLQuantizationType.Q5_K) is None and quant_type_of(0) is None


@pytest.mark.parametrize("name", NAMES)
def test_serves_whole_blocks_only(cpu_tier, name):
    _require_library()
    qtype = QUANT_TYPES[name]
    assert quant_linear_serves(qtype, qtype.block_size * 3)
    assert not quant_linear_serves(qtype, qtype.block_size * 3 + 16)
    assert not quant_linear_serves(qtype, 0)


@pytest.mark.parametrize("name", NAMES)
def test_matches_the_integer_reference(cpu_tier, name):
    """Every shape, dtype pair and bias against the kernel's arithmetic in float64."""
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(qtype.ggml_type)
    case = 0
    for k in _in_features(qtype):
        for n in COLUMNS:
            blocks = _blocks(qtype, n, k, rng)
            packed = pack_quantized(blocks, qtype)
            for m in ROWS:
                for x_dtype, out_dtype in DTYPES:
                    case += 1
                    x = _activations(m, k, x_dtype, rng)
                    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 0.1 if case % 2 else None
                    want, magnitude = _integer_reference(x, blocks, qtype, bias)
                    for weight in (packed, blocks):  # the interleaved layout and the file's
                        got = quant_linear(x, weight, qtype, k, n, bias, out_dtype=out_dtype)
                        assert got.shape == (m, n) and got.dtype == out_dtype
                        _assert_fp32_order_close(got, want, magnitude, k // qtype.block_size)


def _extreme_blocks(qtype: QuantType, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Weights whose integers are all at the format's ends, uint8 [n, k / block * bytes]: per
    column all high, all low, or each byte one of the two at random; the scales and mins at
    their largest too (Q4_K's 6-bit 63, Q6_K's int8 127 and -128), the fp16 scales small."""
    high, low = (0x7F, 0x80) if qtype.name == "Q8_0" else (0xFF, 0x00)
    blocks = np.empty((n, k // qtype.block_size, qtype.block_bytes), dtype=np.uint8)
    for col in range(n):
        pattern = col % 3
        if pattern == 2:
            blocks[col] = np.where(rng.random(blocks.shape[1:]) < 0.5, high, low)
        else:
            blocks[col] = high if pattern == 0 else low
    fp16 = np.full(blocks.shape[:2] + (1,), 1e-3, dtype=np.float16).view(np.uint8)
    if qtype.name == "Q6_K":
        blocks[..., 192:208] = np.where(rng.random(blocks.shape[:2] + (16,)) < 0.5, 0x7F, 0x80)
        blocks[..., 208:210] = fp16
    else:
        blocks[..., 0:2] = fp16
        if qtype.name in ("Q4_1", "Q4_K"):
            blocks[..., 2:4] = fp16
        if qtype.name == "Q4_K":
            blocks[..., 4:16] = 0xFF
    return torch.from_numpy(blocks.reshape(n, -1).copy())


@pytest.mark.parametrize("name", NAMES)
def test_integer_sums_at_their_extremes(cpu_tier, name):
    """The kernels sum byte products in 16-bit lanes where the format's ranges allow: with every
    weight and activation at its end (activations of one magnitude quantize to +-127 each, Q8_0's
    to +-32767), no lane may overflow or saturate."""
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(400 + qtype.ggml_type)
    k, n = _in_features(qtype)[1], 33
    blocks = _extreme_blocks(qtype, n, k, rng)
    packed = pack_quantized(blocks, qtype)
    signs = np.where(rng.random((1, k)) < 0.5, -1.0, 1.0)
    x = torch.from_numpy(np.concatenate([np.ones((1, k)), -np.ones((1, k)), signs, -signs]).astype(np.float32))
    want, magnitude = _integer_reference(x, blocks, qtype, None)
    for weight in (packed, blocks):
        for rows in (x, x[:1]):
            got = quant_linear(rows, weight, qtype, k, n)
            _assert_fp32_order_close(got, want[:rows.shape[0]], magnitude[:rows.shape[0]], k // qtype.block_size)


@pytest.mark.parametrize("name", NAMES)
def test_close_to_dequantize_then_matmul(name):
    """The rounding of the activations, within the format's measured tolerance."""
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(100 + qtype.ggml_type)
    for k in _in_features(qtype):
        blocks = _blocks(qtype, 130, k, rng)
        weight = dequantize(blocks, qtype, k)
        assert weight.shape == (130, k) and weight.dtype == torch.float32
        x = _activations(17, k, torch.float32, rng)
        got = quant_linear(x, pack_quantized(blocks, qtype), qtype, k, 130).double()
        want = x.double() @ weight.double().T
        err = got - want
        relative = float(err.norm() / want.norm())
        assert relative <= MATMUL_TOLERANCE[name], f"relative error {relative:.4f}"
        rms = float(err.pow(2).mean().sqrt())
        assert float(err.abs().max()) <= 8 * rms + 1e-12


def test_dequantize_matches_the_decoded_integers():
    """The test's own block decoder (used by the integer reference) agrees with gguf's."""
    rng = np.random.default_rng(7)
    for qtype in QUANT_TYPES.values():
        k = 2 * qtype.block_size
        blocks = _blocks(qtype, 5, k, rng)
        w = _decode(blocks, qtype, k)
        n, nb = 5, k // qtype.block_size
        if qtype.block_size == 32:
            values = w["d"][..., None] * w["q"]
            if qtype.name == "Q4_1":
                values = values + w["m"][..., None]
        else:
            sub = 32 if qtype.name == "Q4_K" else 16
            q = w["q"].reshape(n, nb, 256 // sub, sub)
            values = (w["d"][..., None, None] * w["sc"][..., None]) * q
            if qtype.name == "Q4_K":
                values = values - (w["dmin"][..., None, None] * w["mn"][..., None])
        np.testing.assert_allclose(values.reshape(n, k), dequantize(blocks, qtype, k).numpy(), rtol=1e-6, atol=1e-9)



PACK_ROWS = (1, 15, 16, 17, 33, 130)  # all tail, one group, groups and a tail


@pytest.mark.parametrize("name", NAMES)
def test_pack_keeps_the_bytes_and_unpacks(name):
    """The interleaved layout: a flat tensor of the same bytes, undone exactly by unpacking."""
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(400 + qtype.ggml_type)
    k = _in_features(qtype)[1]
    for n in PACK_ROWS:
        blocks = _blocks(qtype, n, k, rng)
        packed = pack_quantized(blocks, qtype)
        assert packed.dtype == torch.uint8 and packed.shape == (n * row_bytes(qtype, k),)
        assert torch.equal(unpack_quantized(packed, qtype, k), blocks)
        assert torch.equal(unpack_quantized(blocks, qtype, k), blocks)
        tail = n // 16 * 16  # rows past the last whole group keep the file's layout
        assert torch.equal(packed[tail * row_bytes(qtype, k):], blocks[tail:].reshape(-1))


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_to_equals_gguf(cpu_tier, name):
    """fp32: gguf's values bit for bit; bf16: those rounded to nearest even; whole weights and
    chosen rows, from either layout."""
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(500 + qtype.ggml_type)
    for k in _in_features(qtype):
        for n in PACK_ROWS:
            blocks = _blocks(qtype, n, k, rng)
            want = dequantize(blocks, qtype, k)
            packed = pack_quantized(blocks, qtype)
            assert torch.equal(dequantize(packed, qtype, k), want)
            ids = torch.from_numpy(rng.integers(0, n, size=5))
            for weight in (blocks, packed):
                fp32 = dequantize_to(weight, qtype, k)
                assert fp32.shape == (n, k) and fp32.dtype == torch.float32
                assert torch.equal(fp32, want)
                assert torch.equal(dequantize_to(weight, qtype, k, torch.bfloat16), want.to(torch.bfloat16))
                assert torch.equal(dequantize_to(weight, qtype, k, rows=ids), want[ids])
                assert torch.equal(dequantize_to(weight, qtype, k, torch.bfloat16, rows=ids.view(5, 1)),
                                   want[ids].to(torch.bfloat16))
                wide = torch.zeros((n, k + 32), dtype=torch.bfloat16)  # rows further apart than K
                got = dequantize_to(weight, qtype, k, torch.bfloat16, out=wide[:, :k])
                assert got.data_ptr() == wide.data_ptr() and torch.equal(got, want.to(torch.bfloat16))
                assert not wide[:, k:].any()
    with pytest.raises(IndexError):
        dequantize_to(packed, qtype, k, rows=torch.tensor([n]))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_to(packed, qtype, k, out=torch.empty((n, k), dtype=torch.bfloat16))


@pytest.mark.parametrize("name", NAMES)
def test_rows_alone_are_bit_identical_to_rows_in_a_batch(cpu_tier, name):
    """Same arithmetic order whatever M, the row's tile and the thread count."""
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(200 + qtype.ggml_type)
    k = _in_features(qtype)[1]
    blocks = _blocks(qtype, 130, k, rng)
    packed = pack_quantized(blocks, qtype)
    bias = torch.from_numpy(rng.standard_normal(130).astype(np.float32))
    threads = torch.get_num_threads()
    try:
        for x_dtype, out_dtype in DTYPES:
            x = _activations(17, k, x_dtype, rng)
            batch = quant_linear(x, packed, qtype, k, 130, bias, out_dtype)
            for r in range(17):
                assert torch.equal(quant_linear(x[r:r + 1], packed, qtype, k, 130, bias, out_dtype), batch[r:r + 1])
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                assert torch.equal(quant_linear(x, packed, qtype, k, 130, bias, out_dtype), batch)
                assert torch.equal(quant_linear(x[5:12], packed, qtype, k, 130, bias, out_dtype), batch[5:12])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NAMES)
def test_portable_agrees_with_the_tier_in_use(monkeypatch, name):
    _require_library()
    qtype = QUANT_TYPES[name]
    rng = np.random.default_rng(300 + qtype.ggml_type)
    k = _in_features(qtype)[1]
    blocks = _blocks(qtype, 33, k, rng)
    packed = pack_quantized(blocks, qtype)
    x = _activations(17, k, torch.float32, rng)
    ours = quant_linear(x, packed, qtype, k, 33)
    in_use = isa.selected_tier()
    monkeypatch.setattr(isa, "selected_tier", lambda: isa.Tier.PORTABLE)
    portable = quant_linear(x, packed, qtype, k, 33)
    monkeypatch.setattr(isa, "selected_tier", lambda: in_use)
    _, magnitude = _integer_reference(x, blocks, qtype, None)
    # each within the fp32-order bound of the reference, so of each other within twice it
    allowed = 2 * (k // qtype.block_size + 32) * 2.0**-24 * magnitude
    assert (np.abs(ours.double().numpy() - portable.double().numpy()) <= allowed).all()


def test_leading_dims_strided_rows_and_bad_arguments():
    _require_library()
    qtype = QUANT_TYPES["Q4_0"]
    rng = np.random.default_rng(5)
    blocks = _blocks(qtype, 7, 64, rng)
    packed = pack_quantized(blocks, qtype)
    wide = _activations(6, 128, torch.float32, rng)
    x = wide[:, :64]  # rows 128 apart
    got = quant_linear(x.view(2, 3, 64), packed, qtype, 64, 7)
    assert got.shape == (2, 3, 7)
    assert torch.equal(got.reshape(6, 7), quant_linear(x.contiguous(), packed, qtype, 64, 7))
    with pytest.raises(ValueError, match="features"):
        quant_linear(wide, packed, qtype, 64, 7)
    with pytest.raises(ValueError, match="packed"):
        quant_linear(x, packed[:-1].contiguous(), qtype, 64, 7)
    with pytest.raises(ValueError, match="bytes"):
        quant_linear(x, blocks[:, :-1].contiguous(), qtype, 64, 7)
    with pytest.raises(ValueError, match="uint8"):
        pack_quantized(blocks.view(torch.int8), qtype)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant_linear(x.half(), packed, qtype, 64, 7)
