"""The KV cache's storage formats (`--kv-cache-dtype`): what a stored key or value is, and
the one quantizer every writer uses.

A token's K and V are quantized once, when they are stored (after rotary, so a page's bytes
are final), and every reader takes the stored bytes as they are: the CPU attention kernels
dequantize inside their dot products, and whatever moves pages (the radix tree, the disk tier,
segment copies) moves the bytes and, for int8, their scales.

- `bfloat16`, `float32`: stored as computed, no scales.
- `fp8_e4m3`, `fp8_e5m2`: one byte an element, saturated to the format's largest finite value
  and rounded to nearest even (torch's `float8_e4m3fn` / `float8_e5m2`); no scales, as SGLang
  and vLLM store them by default (a scale of 1).
- `int8`: one byte an element and one fp16 scale per token and KV head: scale = max|x| / 127
  (rounded to fp16), q = round-half-even(x / scale), clamped to [-127, 127]. The fp16 scale
  keeps the page at 2 * D + 2 bytes per head a token (K and V: 2 * (D + 2)), against 4 * D in
  bf16: 1.94x the tokens at a head size of 64.

The element codes (`KVFormat.code`) are the C kernels' (`csrc/dtypes.h`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import KV_CACHE_DTYPES

INT8_LIMIT = 127.0
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KVFormat:
    """One storage format of the KV pool."""

    name: str  # the --kv-cache-dtype name (never "auto": that resolves to the model's dtype)
    storage: torch.dtype  # the pool tensors' element type
    code: int  # the C kernels' element code (csrc/dtypes.h)
    scaled: bool  # int8: a scale per token and KV head beside the pages

    @property
    def quantized(self) -> bool:
        return self.name in ("fp8_e4m3", "fp8_e5m2", "int8")

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes one token's K or V costs per KV head, its scale included."""
        scale = SCALE_DTYPE.itemsize if self.scaled else 0
        return head_dim * self.element_size + scale


FORMATS = {
    "float32": KVFormat("float32", torch.float32, 0, False),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, 1, False),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 2, False),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 3, False),
    "int8": KVFormat("int8", torch.int8, 4, True),
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    """The format `--kv-cache-dtype name` stores; `auto` stores the model's own dtype (fp16
    models store fp16, which only the CUDA backend serves)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name != "auto":
        return FORMATS[name]
    for fmt in FORMATS.values():
        if fmt.storage == model_dtype:
            return fmt
    return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype, -1, False)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] as `fmt` stores it: (data [..., D] of fmt.storage, scales [...] fp16 for int8
    else None). Unquantized formats are a plain cast."""
    if not fmt.quantized:
        return x.to(fmt.storage), None
    xf = x.float()
    if not fmt.scaled:
        limit = _FP8_MAX[fmt.storage]
        return xf.clamp(-limit, limit).to(fmt.storage), None
    scales = (xf.abs().amax(dim=-1) / INT8_LIMIT).clamp(max=torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)
    divisor = scales.float().unsqueeze(-1)
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    data = torch.round(xf / divisor).clamp(-INT8_LIMIT, INT8_LIMIT).to(torch.int8)
    return data, scales


def dequantize(data: torch.Tensor, scales: torch.Tensor | None, fmt: KVFormat,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What the stored `data` (and int8 `scales`) hold, as `dtype`: the reference the kernels'
    in-register dequantization must equal (the products are then taken in fp32)."""
    if not fmt.scaled:
        return data.to(torch.float32).to(dtype)
    assert scales is not None
    return (data.float() * scales.float().unsqueeze(-1)).to(dtype)


def error_bound(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """The largest |dequantize(quantize(x)) - x| the format allows per element of x [..., D]
    (what the round-trip tests check): half a step of the format at x's magnitude."""
    xf = x.float()
    if fmt.name == "float32":
        return torch.zeros_like(xf)
    if fmt.name == "bfloat16":
        return xf.abs() * 2.0 ** -8
    if fmt.name == "int8":
        amax = xf.abs().amax(dim=-1, keepdim=True)
        # half a step, plus the fp16 rounding of the scale (relative 2^-11, or half fp16's
        # subnormal step 2^-24 for scales that small) times at most 127 steps
        return (amax / INT8_LIMIT) * 0.5 * (1 + 2.0 ** -10) + amax * 2.0 ** -11 + INT8_LIMIT * 2.0 ** -25
    mantissa = 3 if fmt.name == "fp8_e4m3" else 2
    smallest = 2.0 ** -9 if fmt.name == "fp8_e4m3" else 2.0 ** -16  # the subnormal step
    limit = _FP8_MAX[fmt.storage]
    over = (xf.abs() - limit).clamp(min=0)  # saturated
    return torch.maximum(xf.abs().clamp(max=limit) * 2.0 ** -(mantissa + 1), torch.full_like(xf, smallest / 2)) + over
