"""The quantized KV cache (--kv-cache-dtype, kernels/kv_quant.py) outside the kernels: the
quantizer's round trip, what a page costs, the pool's store and read, whatever moves pages
(the disk tier, segment copies) moving the bytes and the scales, and the attention backend's
SDPA paths over a quantized pool against attention over the dequantized values."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBatch, AttentionShape
from radixserve.attention.kv_pool import KVPool, raw
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.kernels.kv_quant import FORMATS, dequantize, error_bound, kv_format, quantize
from radixserve.protocol import DiskOps
from radixserve.worker.blend import copy_segment_kv
from radixserve.worker.kv_disk import DiskStore, model_key

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
# the default model (SmolLM2-135M): 30 layers, 3 KV heads of 64
DEFAULT_SHAPE = (30, 16, 3, 64)


def _values(seed: int, shape: tuple[int, ...], magnitude: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * magnitude
    x[0] = 0.0  # an all-zero row: a zero scale must not divide
    x[1, 0, 0] = 500.0  # past fp8_e4m3's largest finite value (448): saturated, not NaN
    return x


@pytest.mark.parametrize("name", ["bfloat16", "float32", *QUANTIZED])
@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 40.0])
def test_round_trips_stay_within_the_format_bound(name, magnitude):
    fmt = FORMATS[name]
    x = _values(1, (64, 3, 64), magnitude)
    data, scales = quantize(x, fmt)
    assert data.dtype == fmt.storage and (scales is not None) == fmt.scaled
    back = dequantize(data, scales, fmt)
    assert torch.isfinite(back).all()
    assert ((back - x).abs() <= error_bound(fmt, x)).all()
    if fmt.quantized:  # and the bound is not vacuous: the values did move
        assert not torch.equal(back, x)


def test_int8_uses_its_whole_range_with_a_scale_per_token_and_head():
    x = _values(2, (8, 3, 64), 5.0)
    data, scales = quantize(x, FORMATS["int8"])
    assert scales.shape == (8, 3) and scales.dtype == torch.float16
    assert (data[2:].abs().amax(-1) == 127).all()  # each row's largest element maps to +-127
    assert torch.equal(data[0], torch.zeros_like(data[0])) and float(scales[0].abs().max()) == 0.0


@pytest.mark.parametrize("name", QUANTIZED)
def test_every_8_bit_kind_holds_at_least_1_9x_the_tokens_of_bf16(name):
    bf16 = KVPool.bytes_per_page(*DEFAULT_SHAPE, FORMATS["bfloat16"])
    assert bf16 / KVPool.bytes_per_page(*DEFAULT_SHAPE, FORMATS[name]) >= 1.9


def test_auto_is_the_model_dtype():
    assert kv_format("auto", torch.bfloat16) is FORMATS["bfloat16"]
    assert kv_format("auto", torch.float32) is FORMATS["float32"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_format("fp4", torch.float32)


def _pool(name: str, dtype: torch.dtype = torch.float32, page_size: int = 2, pages: int = 8) -> KVPool:
    pool = KVPool(2, pages, page_size, 2, 64, dtype, kv_format=FORMATS[name])
    slots = torch.arange(pages * page_size)
    for layer in range(2):
        pool.store(layer, slots, _values(10 + layer, (len(slots), 2, 64), 3.0).to(dtype),
                   _values(20 + layer, (len(slots), 2, 64), 3.0).to(dtype))
    return pool


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_pool_stores_quantized_once_and_reads_the_dequantized_values(name):
    fmt = FORMATS[name]
    pool = KVPool(1, 4, 4, 2, 64, torch.bfloat16, kv_format=fmt)
    assert pool.k[0].dtype == fmt.storage and len(pool.page_tensors()) == (4 if fmt.scaled else 2)
    k, v = _values(3, (5, 2, 64), 2.0).bfloat16(), _values(4, (5, 2, 64), 2.0).bfloat16()
    slots = torch.tensor([3, 7, 8, 1, 12])
    pool.store(0, slots, k, v)
    got_k, got_v = pool.read(0, slots)
    assert got_k.dtype == torch.bfloat16
    want_k = dequantize(*quantize(k, fmt), fmt, torch.bfloat16)
    want_v = dequantize(*quantize(v, fmt), fmt, torch.bfloat16)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def _page(pool: KVPool, page: int) -> list[torch.Tensor]:
    return [t[page].clone() for t in pool.page_tensors()]


def _written(store: DiskStore, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(store.dir.glob("*.kv"))) < n or store._writing:
        assert time.monotonic() < deadline, "the writer did not finish"
        time.sleep(0.01)


def _ready(store: DiskStore, n: int, timeout: float = 10.0) -> tuple[list[bytes], list[bytes]]:
    ready, failed = [], []
    deadline = time.monotonic() + timeout
    while len(ready) + len(failed) < n and time.monotonic() < deadline:
        report = store.report()
        ready, failed = ready + report.ready, failed + report.failed
        time.sleep(0.01)
    return ready, failed


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_page_written_to_disk_comes_back_bit_identical_with_its_scales(tmp_path, name):
    pool = _pool(name)
    store = DiskStore(tmp_path, pool, model_key([], pool))
    bf16_bytes = 2 * 2 * pool.page_size * 2 * 64 * 2
    assert store.payload_bytes == KVPool.bytes_per_page(2, pool.page_size, 2, 64, pool.format) < bf16_bytes * 0.55
    key = hashlib.sha256(b"page").digest()
    want = _page(pool, 3)
    store.apply(DiskOps(store=[(3, key)]))
    _written(store, 1)
    for t in pool.page_tensors():
        raw(t).zero_()  # the pages' ids are reused by other data
    store.apply(DiskOps(prefetch=[key]))
    assert _ready(store, 1) == ([key], [])
    store.apply(DiskOps(load=[(6, key)]))
    got = _page(pool, 6)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want, strict=True))


def test_the_model_key_tells_quantized_weights_from_dequantized_ones():
    """The same GGUF held as quantized blocks computes other K/V than dequantized: the disk tier
    keeps their pages apart (a dequantized model's key is what it was before `--quantization`)."""
    pool = _pool("bfloat16", torch.bfloat16)
    keys = {model_key([], pool), model_key([], pool, "gguf Q4_1+Q8_0"), model_key([], pool, "gguf Q4_K+Q6_K")}
    assert len(keys) == 3 and model_key([], pool, "none") == model_key([], pool)


def test_the_disk_tier_refuses_pages_of_another_kv_dtype(tmp_path, caplog):
    """The KV dtype is part of the model key: another dtype's server looks in another folder,
    and a page file of another dtype planted in its own is dropped, never loaded."""
    int8, bf16 = _pool("int8"), _pool("bfloat16", torch.bfloat16)
    assert model_key([], int8) != model_key([], bf16)
    assert len({model_key([], _pool(name)) for name in QUANTIZED}) == 3
    writer = DiskStore(tmp_path / "a", int8, model_key([], int8))
    key = hashlib.sha256(b"page").digest()
    writer.apply(DiskOps(store=[(2, key)]))
    _written(writer, 1)
    reader = DiskStore(tmp_path / "b", bf16, model_key([], bf16))
    (planted,) = writer.dir.glob("*.kv")
    (reader.dir / planted.name).write_bytes(planted.read_bytes())
    before = _page(bf16, 5)
    reader.apply(DiskOps(prefetch=[key]))
    assert _ready(reader, 1) == ([], [key])
    assert all(torch.equal(a, b) for a, b in zip(_page(bf16, 5), before, strict=True))
    assert reader.report().corrupt_pages == 1


@pytest.mark.parametrize("name", QUANTIZED)
def test_segment_copies_move_bytes_and_scales_and_rotate_keys_requantized(name):
    from radixserve.models.config import RopeConfig
    from radixserve.models.layers import RotaryEmbedding, apply_rotary

    pool, fmt = _pool(name, torch.bfloat16, page_size=4), FORMATS[name]
    rotary = RotaryEmbedding(64, RopeConfig())
    src, dst = torch.arange(0, 6), torch.arange(12, 18)
    deltas = torch.tensor([0, 3, 0, 100, -2, 0])
    before = [pool.read(layer, src, torch.float32) for layer in range(2)]
    raw_before = [[t.view(-1, 2, *t.shape[3:])[src].clone() for t in pool.page_tensors()]]
    copy_segment_kv(pool, rotary, src, dst, deltas)
    cos, sin = rotary(deltas, torch.float32)
    for layer, (k, v) in enumerate(before):
        got_k, got_v = pool.read(layer, dst, torch.float32)
        want_k = dequantize(*quantize(apply_rotary(k, cos, sin), fmt), fmt)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, v)
        assert torch.equal(got_k[deltas == 0], k[deltas == 0])
    # rows moved by 0, and all values, are the same bytes (and scales)
    after = [t.view(-1, 2, *t.shape[3:])[dst] for t in pool.page_tensors()]
    for i, (a, b) in enumerate(zip(after, raw_before[0], strict=True)):
        same = slice(None) if i % 2 else deltas == 0  # V (and V's scales) whole, K where unmoved
        assert torch.equal(a[same].view(torch.uint8) if a.element_size() == 1 else a[same],
                           b[same].view(torch.uint8) if b.element_size() == 1 else b[same])


@pytest.mark.parametrize("name", QUANTIZED)
def test_sdpa_paths_attend_over_what_the_pool_holds(name):
    """Without the CPU kernels (SDPA over dequantized gathers): a prefill chunk, then decode
    rows, each equal to attention over the dequantized K/V computed by hand."""
    fmt, page_size, heads, kv_heads, dim = FORMATS[name], 4, 6, 2, 64
    shape = AttentionShape(heads, kv_heads, dim, dim ** -0.5)
    pool = KVPool(1, 16, page_size, kv_heads, dim, torch.float32, kv_format=fmt)
    backend = TorchNativeBackend(pool, shape, use_cpu_kernel=False)
    gen = torch.Generator().manual_seed(5)
    n = 11
    q, k, v = (torch.randn(n, h, dim, generator=gen) * 2 for h in (heads, kv_heads, kv_heads))
    pages = torch.tensor([[5, 2, 9, 0]])
    backend.plan(AttentionBatch(page_size, pages, [0], [n]))
    out = backend.forward(q, k, v, 0)
    kq = dequantize(*quantize(k, fmt), fmt).repeat_interleave(heads // kv_heads, 1)
    vq = dequantize(*quantize(v, fmt), fmt).repeat_interleave(heads // kv_heads, 1)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), kq.transpose(0, 1), vq.transpose(0, 1),
                                          is_causal=True, scale=shape.scale).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # one decode token after them, over the stored (quantized) context
    q1, k1, v1 = (torch.randn(1, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    backend.plan(AttentionBatch(page_size, pages, [n], [1]))
    out1 = backend.forward(q1, k1, v1, 0)
    kq = torch.cat([kq, dequantize(*quantize(k1, fmt), fmt).repeat_interleave(3, 1)])
    vq = torch.cat([vq, dequantize(*quantize(v1, fmt), fmt).repeat_interleave(3, 1)])
    want1 = F.scaled_dot_product_attention(q1.transpose(0, 1), kq.transpose(0, 1), vq.transpose(0, 1),
                                           scale=shape.scale).transpose(0, 1)
    torch.testing.assert_close(out1, want1, rtol=1e-5, atol=1e-5)
