"""oneDNN-prepacked bf16 linears give exactly what F.linear gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.models.loader import load_model
from radixserve.models.packed_linear import PackedLinear, can_pack, pack_linears

needs_packing = pytest.mark.skipif(
    not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)), reason="torch has no oneDNN linear packing here"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 32, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    assert torch.equal(PackedLinear(weight, b)(x), F.linear(x, weight, b))


@needs_packing
def test_only_bf16_cpu_weights_are_packed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    assert pack_linears(model) == 1
    assert type(model[0]) is torch.nn.Linear  # fp32 keeps F.linear (the exactness dtype)
    assert isinstance(model[1], PackedLinear)


@needs_packing
@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2"])
def test_packed_model_gives_the_same_logits(tiny_model_dirs, name):
    """Every linear and the (tied or untied) lm_head packed: logits unchanged to the bit."""
    from radixserve.worker.attention.base import AttentionBatch
    from radixserve.worker.attention.torch_native import TorchNativeBackend
    from radixserve.worker.kv_pool import KVPool

    outputs = []
    for pack in (False, True):
        loaded = load_model(str(tiny_model_dirs[name]), dtype=torch.bfloat16, pack_weights=pack)
        model = loaded.model
        assert any(isinstance(m, PackedLinear) for m in model.modules()) == pack
        assert (model.lm_head is not None) == (pack or not loaded.config.tie_word_embeddings)
        shape = model.attention_shape()
        pool = KVPool(loaded.config.num_layers, 8, 16, shape.num_kv_heads, shape.head_dim, torch.bfloat16)
        backend = TorchNativeBackend(pool, shape)
        tokens = torch.arange(3, 23)
        backend.plan(AttentionBatch(16, torch.tensor([[0, 1]]), [0], [20]))
        with torch.inference_mode():
            hidden = model(tokens, torch.arange(20), backend)
            outputs.append(model.compute_logits(hidden))
    assert torch.equal(outputs[0], outputs[1])
