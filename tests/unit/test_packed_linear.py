"""Packed CPU linears: oneDNN-packed bf16 gives exactly what F.linear gives; radixserve's panel
kernel gives F.linear's fp32 sums to a few ulps (bf16: then rounded once), for every tile shape,
on the build of every ISA tier (bf16 on all but the portable one); and which of the two serves
where."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa
from radixserve.models.loader import load_model
from radixserve.models.packed_linear import (
    OneDNNLinear,
    PanelLinear,
    fp32_logits_head,
    pack_linears,
    packed_linear,
)

# a compiler, not a built library: building is the tier's business, at test time
needs_kernels = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler on this machine")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _skip_unless_built_for(dtype: torch.dtype) -> None:
    """The build for the tier in use has a tile for dtype (the policy in `linear_serves` aside):
    the portable build has none for bf16."""
    if not cpu_kernels.load_library().linear_serves(cpu_kernels.DTYPE_CODES[dtype]):
        pytest.skip(f"the {isa.selected_tier()} build of the kernel has no {dtype} tile")


def _skip_unless_onednn_packs_bf16() -> None:
    """oneDNN packs bf16 weights with AVX-512 (or AVX-NE-CONVERT); a forced lower tier caps it
    to that tier's ISA (kernels/isa.py), so it is asked at test time, not at import."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN does not pack bf16 linears here")


def _problem(rows: int, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    return x, weight, b


def _assert_ulps_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype | None = None):
    """fp32 sums in another order: within a few ulps of the sum of |terms| of the exact result;
    bf16 outputs also within half a bf16 step (at most 2^-8 relative) of it, their one rounding.
    Outputs are in x's dtype unless `out_dtype` says otherwise."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (0 if bias is None else bias.double().abs())
    assert got.shape == exact.shape and got.dtype == (out_dtype or x.dtype)
    rounding = 2.0**-8 * exact.abs() if got.dtype == torch.bfloat16 else 0.0
    assert ((got.double() - exact).abs() <= 4 * x.shape[-1] ** 0.5 * 6e-8 * magnitude * (1 + 2.0**-8) + rounding + 1e-30).all()


@pytest.mark.parametrize("rows", [1, 7, 32, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_is_bit_identical_to_f_linear(rows, bias):
    _skip_unless_onednn_packs_bf16()
    x, weight, b = _problem(rows, 80, 96, bias, torch.bfloat16, seed=rows)
    assert torch.equal(OneDNNLinear(weight, b)(x), F.linear(x, weight, b))


@needs_kernels
@DTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 241, 500])  # every tile height, several row chunks
# whole panels (of 32 and 64 columns), fewer columns than a panel, and a last panel cut
# after 2 or 13 columns (mid-vector for 8 and 16 lanes)
@pytest.mark.parametrize(("in_features", "out_features"), [(80, 96), (576, 960), (34, 5), (1536, 576), (64, 130), (48, 77)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear(rows, in_features, out_features, bias, dtype, cpu_tier):
    _skip_unless_built_for(dtype)
    x, weight, b = _problem(rows, in_features, out_features, bias, dtype, seed=rows)
    got = PanelLinear(weight, b)(x)
    _assert_ulps_close(got, x, weight, b)


@needs_kernels
@DTYPES
# bf16 on AVX2: tall tiles of 4 to 6 rows, split evenly (9: 4 + 5, 11: 5 + 6); from 12 rows
# (AVX-512F: 24) a panel widened once; row chunks
@pytest.mark.parametrize("rows", [4, 6, 9, 11, 13, 17, 24, 241])
@pytest.mark.parametrize("out_fp32", [False, True], ids=["out-input-dtype", "out-fp32"])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(rows, dtype, out_fp32, cpu_tier):
    """Each row is the same numbers computed alone or among many (a checked draft's rows are
    then what plain decoding computes, one token at a time): however the kernel groups rows
    into tiles (tall ones for a checked draft's rows on AVX2), and where it widens a bf16
    panel to fp32 once for all its tiles, every output is one dot product in k order."""
    _skip_unless_built_for(dtype)
    if out_fp32 and dtype != torch.bfloat16:
        pytest.skip("fp32 outputs of fp32 inputs are the default")
    x, weight, b = _problem(rows, 576, 1100, True, dtype, seed=rows)  # panels enough not to split
    layer = PanelLinear(weight, b, out_dtype=torch.float32 if out_fp32 else None)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 13])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 130), (64, 77), (34, 5)])
def test_bf16_inputs_with_fp32_outputs_are_the_sums_unrounded(rows, in_features, out_features, cpu_tier):
    """`out_dtype` float32 (an LM head's logits): the fp32 sums within fp32 ulps of exact, with
    no bf16 rounding, and the bf16 output is exactly their one rounding."""
    _skip_unless_built_for(torch.bfloat16)
    x, weight, b = _problem(rows, in_features, out_features, True, torch.bfloat16, seed=rows)
    sums = PanelLinear(weight, b, out_dtype=torch.float32)(x)
    _assert_ulps_close(sums, x, weight, b, out_dtype=torch.float32)
    assert torch.equal(sums.bfloat16(), PanelLinear(weight, b)(x))


@needs_kernels
def test_a_bf16_lm_head_keeps_near_ties_apart(cpu_tier):
    """Two logits 1/16 apart near 25 round to the same bf16 (1/8 apart there), and greedy
    argmax would take the lower token id: the head's fp32 logits keep the likelier token first.
    (A CI machine at the avx512 tier answered "L'Étoile" to the capital of France this way.)"""
    _skip_unless_built_for(torch.bfloat16)
    weight = torch.zeros(4, 64, dtype=torch.bfloat16)
    weight[:, 0] = 25.0
    weight[:, 1] = torch.tensor([0.0, 0.34375, 0.40625, -3.0])  # logits 25, 25.34375, 25.40625, 22
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, :2] = 1.0
    rounded = PanelLinear(weight, None)(x).float()
    assert rounded[0, 1] == rounded[0, 2] == 25.375 and int(rounded.argmax()) == 1  # the tie
    head = fp32_logits_head(weight)
    assert head is not None and head.out_dtype == torch.float32
    logits = head(x)
    assert logits.tolist() == [[25.0, 25.34375, 25.40625, 22.0]] and int(logits.argmax()) == 2


@needs_kernels
def test_odd_fp32_input_size(cpu_tier):
    x, weight, b = _problem(9, 33, 70, True, torch.float32)
    _assert_ulps_close(PanelLinear(weight, b)(x), x, weight, b)


@needs_kernels
@DTYPES
def test_panel_linear_reads_strided_rows_and_leading_dims(dtype, cpu_tier):
    _skip_unless_built_for(dtype)
    x, weight, b = _problem(12, 64, 70, True, dtype)
    layer = PanelLinear(weight, b)
    wide = torch.randn(12, 100).to(dtype)
    wide[:, 10:74] = x
    _assert_ulps_close(layer(wide[:, 10:74]), x, weight, b)  # rows 100 elements apart
    batched = layer(x.view(3, 4, 64))
    assert batched.shape == (3, 4, 70) and torch.equal(batched.view(12, 70), layer(x))


@needs_kernels
def test_every_build_but_the_portable_one_serves_bf16(cpu_tier):
    """bf16 needs SIMD to widen its pairs (AVX2, AVX-512) or multiply them (AVX-512 BF16); the
    portable build (no ISA flags) serves fp32 only. Each build packs its own panel width."""
    lib = cpu_kernels.load_library(cpu_tier)
    assert lib.linear_serves(cpu_kernels.DTYPE_CODES[torch.float32])
    assert bool(lib.linear_serves(cpu_kernels.DTYPE_CODES[torch.bfloat16])) == (cpu_tier > isa.Tier.PORTABLE)
    width = lib.linear_panel_width()
    assert cpu_kernels.pack_linear(torch.randn(width + 1, 8)).shape == (2, 8, width)


@needs_kernels
def test_fp32_and_bf16_cpu_weights_are_packed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16(), torch.nn.Linear(8, 8).half())
    expected = 1 + (packed_linear(torch.empty(1, 2, dtype=torch.bfloat16), None) is not None)
    assert pack_linears(model) == expected
    assert isinstance(model[0], PanelLinear)
    bf16_panels = cpu_kernels.linear_serves(torch.bfloat16, 8)
    assert isinstance(model[1], PanelLinear if bf16_panels else (OneDNNLinear, torch.nn.Linear))
    assert type(model[2]) is torch.nn.Linear  # fp16: no packed form on the CPU


@needs_kernels
def test_bf16_takes_onednn_on_amx_cpus_and_for_odd_input_sizes(monkeypatch):
    """oneDNN runs bf16 on AMX tiles where the CPU has them (prefill is compute-bound); the
    panel kernel multiplies pairs, so an odd input size also stays with oneDNN."""
    _skip_unless_onednn_packs_bf16()
    weight = torch.randn(16, 9).bfloat16()
    assert isinstance(packed_linear(weight, None), OneDNNLinear)
    monkeypatch.setattr(cpu_kernels, "torch_owns_bf16_matmuls", lambda: True)
    assert isinstance(packed_linear(torch.randn(16, 8).bfloat16(), None), OneDNNLinear)
    assert isinstance(packed_linear(torch.randn(16, 8), None), PanelLinear)


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_model_gives_the_same_logits(tiny_model_dirs, name, dtype):
    """Every linear and the (tied or untied) lm_head packed: logits unchanged to the last bits
    (bf16 through oneDNN: hidden states to the bit); a bf16 head where the panel kernel builds
    bf16 gives fp32 logits, the sums unrounded."""
    from radixserve.attention.base import AttentionBatch
    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.torch_native import TorchNativeBackend

    if packed_linear(torch.empty(1, 2, dtype=dtype), None) is None:  # bf16 pairs: an even size
        pytest.skip(f"no packed linear for {dtype} here")
    outputs = []
    for pack in (False, True):
        loaded = load_model(str(tiny_model_dirs[name]), dtype=dtype, pack_weights=pack)
        model = loaded.model
        assert any(isinstance(m, (OneDNNLinear, PanelLinear)) for m in model.modules()) == pack
        assert (model.lm_head is not None) == (pack or not loaded.config.tie_word_embeddings)
        shape = model.attention_shape()
        pool = KVPool(loaded.config.num_layers, 8, 16, shape.num_kv_heads, shape.head_dim, dtype)
        backend = TorchNativeBackend(pool, shape)
        tokens = torch.arange(3, 23)
        backend.plan(AttentionBatch(16, torch.tensor([[0, 1]]), [0], [20]))
        with torch.inference_mode():
            hidden = model(tokens, torch.arange(20), backend)
            outputs.append((hidden, model.compute_logits(hidden)))
    (hidden, logits), (packed_hidden, packed_logits) = outputs
    if any(isinstance(m, OneDNNLinear) for m in model.modules()):
        assert torch.equal(hidden, packed_hidden)
    # bf16: a sum that lands next to a rounding boundary can round the other way
    assert (logits - packed_logits).abs().max() < (0.1 if dtype == torch.bfloat16 else 1e-5)
    if fp32_logits_head(model.embed_tokens.weight) is not None:  # bf16 logits, not rounded to bf16
        assert isinstance(model.lm_head, PanelLinear) and model.lm_head.out_dtype == torch.float32
        assert (packed_logits.view(torch.int32) & 0xFFFF).any()
        assert not (logits.view(torch.int32) & 0xFFFF).any()


def test_a_user_cap_below_avx512_on_onednn_leaves_bf16_layers_unpacked(monkeypatch):
    """ONEDNN_MAX_CPU_ISA set by the user below AVX-512 makes oneDNN refuse bf16 packing on a
    CPU that has it: the model still loads, its layers unpacked (a warning, not a crash). An odd
    input size goes to oneDNN on every tier from avx512 up (the panel kernel takes even ones
    below AMX), so the refusal is met on AMX and non-AMX CPUs alike."""
    _skip_unless_onednn_packs_bf16()
    code = (
        "import torch\n"
        "from radixserve.models import packed_linear as p\n"
        "w = torch.randn(64, 95).bfloat16()\n"
        "assert p.packed_linear(w, None) is None and p.packed_linear(w, None) is None and p._ONEDNN_REFUSED\n"
        "x = torch.randn(3, 95).bfloat16()\n"
        "print('ok', torch.nn.functional.linear(x, w).shape)\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert "oneDNN refused to pack bf16 weights" in out.stderr
