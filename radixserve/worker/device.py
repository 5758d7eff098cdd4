"""Choosing the device and dtype the worker runs on."""

from __future__ import annotations

import torch

from radixserve.kernels import isa

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when it is available, else the CPU; `cuda:K` is GPU K of several (one
    replica per GPU on a multi-GPU machine, docs/deploy.md)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for, but torch sees no CUDA device")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r} was asked for, but torch sees {count} CUDA device(s): cuda:0..cuda:{count - 1}")
    return device


def use_device(name: str) -> torch.device:
    """Resolve the device and make a CUDA one the process's current device, so what is created
    without naming a device (CUDA streams, graphs and their memory pool, library workspaces)
    lands on the GPU the model is on, not on GPU 0."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def cpu_prefers_bf16() -> bool:
    """Whether bf16 beats fp32 on the CPU ISA tier in use: from avx2 up (`python -m bench.model_runner --dtypes float32 bfloat16`).
    With bf16 pair arithmetic (avx512_bf16, amx) it is faster throughout; on avx2 and avx512,
    where the kernels widen bf16 to fp32 in registers, a decode step (bound by reading weights
    and KV) is much faster and a prefill a little slower, and the KV pool holds twice the
    tokens. The portable build has no bf16 linear kernel, so it stays fp32."""
    return isa.at_least(isa.Tier.AVX2)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPU ISA tiers where it is faster, fp32 elsewhere (fp32 is
    always exact)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_prefers_bf16():
        return torch.bfloat16
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]
