"""Attention backends behind one registry; each backend module is imported only when chosen.

    auto          flashinfer when the pool is on CUDA, flashinfer imports, and the model's
                  head size and dtype are ones its kernels serve; torch_native otherwise
    flashinfer    CUDA only (`pip install radixserve[cuda]`); asking for it where it cannot
                  run is a ValueError that says what is missing (an int8 KV cache too: it
                  reads fp8 pages, not scaled int8 ones)
    torch_native  anywhere; the reference for tests

A CPU-only install never imports flashinfer or any CUDA code through this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from radixserve.config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from radixserve.attention.base import AttentionBackend, AttentionShape
    from radixserve.attention.kv_pool import KVPool

log = logging.getLogger("radixserve.worker")

INSTALL_HINT = "install it with `pip install radixserve[cuda]` (see docs/cuda.md)"
# head sizes and dtypes FlashInfer's prebuilt kernel templates are instantiated for
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flashinfer backend cannot serve this pool, or None when it can.

    Imports flashinfer only when everything else fits (a CUDA device, a supported dtype and
    head size), so nothing CUDA is imported on a CPU worker.
    """
    if device.type != "cuda":
        return f"needs a CUDA device, and this worker runs on {device}"
    if dtype not in FLASHINFER_DTYPES:
        return f"serves float16 and bfloat16 only, not {str(dtype).removeprefix('torch.')} (choose --dtype)"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"serves head sizes {list(FLASHINFER_HEAD_DIMS)}, and this model's is {head_dim}"
    if importlib.util.find_spec("flashinfer") is None:
        return f"needs the flashinfer package, which is not installed; {INSTALL_HINT}"
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # a broken install: name it instead of failing later
        return f"could not import flashinfer ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`auto` -> the backend that will run; an explicit name is checked and returned."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch_native":
        return name
    problem = flashinfer_problem(device, dtype, head_dim)
    if name == "flashinfer":
        if problem is not None:
            raise ValueError(f"attention backend 'flashinfer' {problem}; or use --attention-backend torch_native")
        return name
    if problem is not None and device.type == "cuda":
        log.warning("attention backend auto: torch_native, because flashinfer %s", problem)
    return "torch_native" if problem is not None else "flashinfer"


def create_backend(
    name: str, pool: KVPool, shape: AttentionShape, device: torch.device | str
) -> AttentionBackend:
    """Build the backend `name` (auto | flashinfer | torch_native) over `pool`."""
    device = torch.device(device)
    chosen = resolve_backend_name(name, device, pool.dtype, shape.head_dim)
    if chosen == "flashinfer" and pool.converted and not (pool.quantized and not pool.format.scaled):
        # FlashInfer reads fp8 pages (a scale of 1), not int8 ones with scales per token, nor
        # a KV dtype wider than the model's
        if name == "flashinfer":
            raise ValueError(f"attention backend 'flashinfer' reads the model's dtype, fp8_e4m3 or fp8_e5m2 KV, "
                             f"not {pool.format.name}; choose one of those or --attention-backend torch_native")
        log.warning("attention backend auto: torch_native, because flashinfer does not read %s KV", pool.format.name)
        chosen = "torch_native"
    if chosen == "flashinfer":
        from radixserve.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(pool, shape)
    from radixserve.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(pool, shape)
