"""Which path a quantized layer's prefill chunk takes (models/gguf_quantized.py): WIDEN_ROWS rows
or more widen the weight for a dense matmul, except the formats whose kernels are faster at
this ISA tier (`prefills_on_kernels`: the 4-bit formats on AVX2), which stay on the kernels.
A fused layer of mixed formats (Q4_K_M's q/k in Q4_K beside v in Q6_K) splits per part."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa
from radixserve.kernels.quant_linear import QUANT_TYPES, dequantize, pack_quantized, quant_linear
from radixserve.models.gguf_quantized import (
    WIDEN_ROWS,
    QuantizedLinear,
    QuantizedPart,
    prefills_on_kernels,
)

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="the CPU kernels are off here")

IN_FEATURES = 512


def _part(name: str, rows: int, rng: np.random.Generator) -> tuple[QuantizedPart, torch.Tensor]:
    """A K-quant part of `rows` outputs (random bytes, small fp16 scales), and its file-layout
    blocks."""
    qtype = QUANT_TYPES[name]
    raw = rng.integers(0, 256, size=(rows, IN_FEATURES // 256, qtype.block_bytes), dtype=np.uint8)
    scale = np.full((rows, IN_FEATURES // 256, 1), 1e-3, dtype=np.float16).view(np.uint8)
    if name == "Q4_K":
        raw[..., 0:2], raw[..., 2:4] = scale, scale  # d, dmin
    else:
        raw[..., 208:210] = scale  # Q6_K's d
    blocks = torch.from_numpy(raw.reshape(rows, -1).copy())
    return QuantizedPart(qtype, rows, pack_quantized(blocks, qtype)), blocks


@pytest.mark.parametrize("tier", [isa.Tier.PORTABLE, isa.Tier.AVX2])
def test_a_prefill_chunk_widens_only_the_formats_the_kernels_lose_on(monkeypatch, tier):
    if not isa.at_least(tier):
        pytest.skip(f"this CPU has no {tier}")
    monkeypatch.setattr(isa, "selected_tier", lambda: tier)
    rng = np.random.default_rng(7)
    (q4k, q4k_blocks), (q6k, q6k_blocks) = _part("Q4_K", 48, rng), _part("Q6_K", 16, rng)
    layer = QuantizedLinear(IN_FEATURES, [q4k, q6k], bias=False)
    x = torch.randn(WIDEN_ROWS + 2, IN_FEATURES)
    out = layer(x)
    kernel_q4k = quant_linear(x, q4k.packed, q4k.qtype, IN_FEATURES, 48)
    widened_q6k = F.linear(x, dequantize(q6k_blocks, q6k.qtype, IN_FEATURES))
    widened_both = F.linear(x, torch.cat([dequantize(q4k_blocks, q4k.qtype, IN_FEATURES), dequantize(q6k_blocks, q6k.qtype, IN_FEATURES)]))
    assert prefills_on_kernels(q4k.qtype) == (tier == isa.Tier.AVX2)
    assert not prefills_on_kernels(q6k.qtype)
    if tier == isa.Tier.AVX2:
        # Q4_K on the kernels, whatever the row count: the chunk's rows are the decode rows
        assert torch.equal(out[:, :48], kernel_q4k)
        assert torch.equal(layer(x[:3])[:, :48], out[:3, :48])
        assert torch.allclose(out[:, 48:], widened_q6k, rtol=1e-4, atol=1e-5)
    else:
        assert torch.allclose(out, widened_both, rtol=1e-4, atol=1e-5)
        assert not torch.equal(out[:, :48], kernel_q4k)  # int8 activations differ from the dense matmul
