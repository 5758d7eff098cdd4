"""Linear layers over GGUF-quantized weights kept in their blocks (csrc/quant_linear.c).

A GGUF file's Q4_0 or Q4_K weights take a quarter to a third of the bytes of bf16, and decode
on the CPU is bound by reading the weights: dequantizing them at load gives that back. These
kernels keep the file's blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and dequantize inside the dot
products, the way llama.cpp's CPU backend does: each activation row is quantized once per call
to int8 blocks with an fp32 scale (blocks of 32 for the 32-value formats, with the block sum for
Q4_1's min; blocks of 256 with sums of 16 for the K-quants), the weight x activation products
are summed exactly in integers per block, and each block's integer sum is scaled to fp32 and
summed in fp32. The result is therefore not dequantize-then-matmul: the activations carry an
int8 rounding (about 0.2-0.5 % of a row's dot product, see tests/unit/test_quant_linear.py),
as in llama.cpp. Except for Q8_0, whose near-lossless weights would be wasted on it: its
activations are quantized to int16 instead (about 2e-5 of a dot product) and multiplied with
the int8 weights by int16 multiplies (vpmaddwd, vpdpwssd).

Weights come in two layouts. The file's: the GGUF tensor's bytes, uint8 [N, K / block_size *
block_bytes], row after row. The packed one (`pack_quantized`, once at load): a flat uint8 [N *
row bytes], the same number of bytes, where groups of 16 rows have their blocks interleaved so
that the kernels compute 16 output columns in the lanes of one vector (csrc/quant_linear.c
describes the layout); rows past the last whole group stay in the file's layout. Rows of the
packed layout cannot be sliced out of it: take them with `dequantize_to(..., rows=ids)` or
`unpack_quantized`. `quant_linear`, `dequantize` and `dequantize_to` take either layout (a 2-D
tensor is the file's, a 1-D one the packed). `quant_linear_serves` says where the kernels serve a
type and input size: the library built (`radixserve.kernels.cpu`) and K a multiple of the type's
block; elsewhere callers dequantize (`dequantize`) and use a plain linear layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.kernels import cpu


@dataclass(frozen=True)
class QuantType:
    """A GGUF block format: GGML's type id, values per block and bytes per block."""

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int


QUANT_TYPES: dict[str, QuantType] = {
    "Q8_0": QuantType("Q8_0", 8, 32, 34),
    "Q4_0": QuantType("Q4_0", 2, 32, 18),
    "Q4_1": QuantType("Q4_1", 3, 32, 20),
    "Q4_K": QuantType("Q4_K", 12, 256, 144),
    "Q6_K": QuantType("Q6_K", 14, 256, 210),
}
_BY_ID = {qtype.ggml_type: qtype for qtype in QUANT_TYPES.values()}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def quant_type_of(ggml_type: int) -> QuantType | None:
    """The served format with this GGML type id (gguf.GGMLQuantizationType), or None."""
    return _BY_ID.get(int(ggml_type))


def quant_linear_serves(qtype: QuantType, in_features: int) -> bool:
    """Whether `quant_linear` serves weights of `qtype` with this input size here: the kernel
    library loads, its build serves the type, and in_features is a multiple of the block."""
    lib = cpu.load_library()
    return (lib is not None and quant_type_of(qtype.ggml_type) == qtype and in_features > 0
            and in_features % qtype.block_size == 0 and bool(lib.quant_linear_serves(qtype.ggml_type)))


def row_bytes(qtype: QuantType, in_features: int) -> int:
    """Bytes of one weight row (one output feature) of `in_features` values."""
    if in_features % qtype.block_size:
        raise ValueError(f"{qtype.name} stores rows in blocks of {qtype.block_size}: {in_features} is not a multiple")
    return in_features // qtype.block_size * qtype.block_bytes


def _check_file_layout(blocks: torch.Tensor, qtype: QuantType) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % qtype.block_bytes:
        raise ValueError(f"{qtype.name} weights must be uint8 [N, blocks * {qtype.block_bytes}], "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    if blocks.device.type != "cpu":
        raise ValueError("quantized weights must be on the CPU")


def _rows_of(weight: torch.Tensor, qtype: QuantType, in_features: int) -> int:
    """N of a weight in either layout (a 2-D tensor: the file's; 1-D: `pack_quantized`'s)."""
    per_row = row_bytes(qtype, in_features)
    if weight.dtype != torch.uint8 or weight.dim() not in (1, 2) or weight.device.type != "cpu":
        raise ValueError(f"{qtype.name} weights must be uint8 on the CPU, 2-D (the file's layout) or 1-D "
                         f"(pack_quantized's), got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if weight.dim() == 2:
        if weight.shape[1] != per_row:
            raise ValueError(f"{qtype.name} rows of {in_features} values take {per_row} bytes, got {tuple(weight.shape)}")
        return weight.shape[0]
    if weight.numel() % per_row:
        raise ValueError(f"packed {qtype.name} weights of {weight.numel()} bytes are not whole rows of {per_row}")
    return weight.numel() // per_row


def pack_quantized(blocks: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """The GGUF tensor's bytes, uint8 [N, K / block_size * block_bytes] in the file's block
    layout -> what `quant_linear` reads fastest: the same bytes rearranged (once, at load) into
    the interleaved layout, a flat uint8 [N * row bytes] (see the top of the file). Where the
    kernel library does not load, the file's layout, checked and made contiguous."""
    _check_file_layout(blocks, qtype)
    blocks = blocks.contiguous()
    lib = cpu.load_library()
    if lib is None or quant_type_of(qtype.ggml_type) != qtype:
        return blocks
    in_features = blocks.shape[1] // qtype.block_bytes * qtype.block_size
    packed = torch.empty(blocks.numel(), dtype=torch.uint8)
    if lib.quant_pack(blocks.data_ptr(), blocks.shape[0], in_features, qtype.ggml_type, packed.data_ptr(), 0,
                      torch.get_num_threads()):
        raise ValueError(f"the kernels do not serve {qtype.name}")
    return packed


def unpack_quantized(packed: torch.Tensor, qtype: QuantType, in_features: int) -> torch.Tensor:
    """A weight in either layout -> the file's layout, uint8 [N, row bytes] (a 2-D input is
    returned as it is)."""
    n = _rows_of(packed, qtype, in_features)
    if packed.dim() == 2:
        return packed
    lib = cpu.load_library()
    if lib is None:
        raise RuntimeError("unpacking a packed quantized weight needs the CPU kernel library")
    packed = packed.contiguous()
    blocks = torch.empty((n, row_bytes(qtype, in_features)), dtype=torch.uint8)
    if lib.quant_pack(packed.data_ptr(), n, in_features, qtype.ggml_type, blocks.data_ptr(), 1, torch.get_num_threads()):
        raise ValueError(f"the kernels do not serve {qtype.name} with {in_features} inputs")
    return blocks


def quant_linear(x: torch.Tensor, packed: torch.Tensor, qtype: QuantType, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias, W given as `pack_quantized(blocks)` (or in the file's layout,
    slower); x fp32 or bf16 with a
    contiguous last dim; bias [N] (added in fp32); the output in x's dtype or `out_dtype` (fp32
    or bf16, rounded once to nearest even). Only call after `quant_linear_serves` said yes."""
    lib = cpu.load_library()
    assert lib is not None
    out_dtype = out_dtype or x.dtype
    if x.dtype not in _DTYPE_CODES or out_dtype not in _DTYPE_CODES:
        raise ValueError(f"inputs and outputs must be float32 or bfloat16, got {x.dtype} -> {out_dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer {in_features}")
    if _rows_of(packed, qtype, in_features) != out_features or not packed.is_contiguous():
        raise ValueError(f"packed {qtype.name} weights must be contiguous uint8 [{out_features} * "
                         f"{row_bytes(qtype, in_features)}] (or [{out_features}, {row_bytes(qtype, in_features)}] "
                         f"in the file's layout), got {packed.dtype} {tuple(packed.shape)}")
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
        if bias.shape != (out_features,):
            raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
    out = torch.empty((rows.shape[0], out_features), dtype=out_dtype)
    failed = lib.quant_linear(rows.data_ptr(), rows.stride(0), rows.shape[0], in_features, packed.data_ptr(),
                              out_features, qtype.ggml_type, int(packed.dim() == 1), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), out.stride(0), _DTYPE_CODES[x.dtype], _DTYPE_CODES[out_dtype],
                              torch.get_num_threads())
    if failed == 1:
        raise MemoryError("the quantized linear kernel could not allocate its scratch memory")
    if failed:
        raise ValueError(f"the quantized linear kernel does not serve {qtype.name} with {in_features} inputs")
    return out.view(*x.shape[:-1], out_features)


def dequantize(blocks: torch.Tensor, qtype: QuantType, in_features: int) -> torch.Tensor:
    """The weight the blocks hold (either layout), fp32 [N, K], by gguf's numpy dequantization:
    the reference (`dequantize_to` gives the same values, faster)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    blocks = unpack_quantized(blocks, qtype, in_features)
    data = np.ascontiguousarray(blocks.cpu().numpy().view(np.uint8))
    values = gguf_dequantize(data, GGMLQuantizationType(qtype.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, in_features)


def dequantize_to(blocks: torch.Tensor, qtype: QuantType, in_features: int, dtype: torch.dtype = torch.float32,
                  rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight the blocks hold (either layout), [N, K] in fp32 or bf16, or with `rows` (int
    indices) only those rows, [len(rows), K]: the C kernels, in parallel over rows. fp32 values
    equal `dequantize`'s bit for bit; bf16 ones are those rounded to nearest even. `out` (that
    shape and dtype, rows with unit stride) is written and returned instead of a new tensor: a
    caller widening a weight for every prefill chunk should keep one, since first touching a
    fresh tensor of that size costs more than the dequantization. Needs the kernel library
    (`quant_linear_serves`)."""
    lib = cpu.load_library()
    if lib is None:
        raise RuntimeError("dequantize_to needs the CPU kernel library")
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"dequantize_to writes float32 or bfloat16, not {dtype}")
    n = _rows_of(blocks, qtype, in_features)
    blocks = blocks.contiguous()
    index = None
    count = n
    if rows is not None:
        index = rows.reshape(-1).to(torch.int64).contiguous()
        count = index.numel()
    if out is None:
        out = torch.empty((count, in_features), dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != (count, in_features) or out.stride(1) != 1 or out.device.type != "cpu":
        raise ValueError(f"out must be a CPU {dtype} [{count}, {in_features}] with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)}")
    failed = lib.quant_dequantize(blocks.data_ptr(), n, in_features, qtype.ggml_type, int(blocks.dim() == 1),
                                  None if index is None else index.data_ptr(), count, out.data_ptr(), out.stride(0),
                                  _DTYPE_CODES[dtype], torch.get_num_threads())
    if failed == 3:
        raise IndexError(f"row index out of range for a weight of {n} rows")
    if failed:
        raise ValueError(f"the kernels do not serve {qtype.name} with {in_features} inputs")
    return out
