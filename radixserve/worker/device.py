"""Choosing the device and dtype the worker runs on."""

from __future__ import annotations

import torch

from radixserve.kernels import isa

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when it is available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """Whether bf16 beats fp32 on the CPU ISA tier in use (docs/benchmarks.md): from
    avx512_bf16 up, where the CPU multiplies bf16 pairs (AMX tiles or the AVX-512 BF16 dot
    product)."""
    return isa.at_least(isa.Tier.AVX512_BF16)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere (fp32 is always exact)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]
