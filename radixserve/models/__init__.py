"""Model definitions, weight loading and model resolution (default / HF folder / GGUF).

`ModelConfig` and `resolve_model` do not import torch; the loader names (`load_model`,
`LoadedModel`, `ARCHITECTURES`) are imported on first use, so a process that only needs a
model's config or folder never pays for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.models.config import ModelConfig, RopeConfig
from radixserve.models.resolve import ModelNotFoundError, default_gguf, resolve_model

if TYPE_CHECKING:
    from radixserve.models.llama import ARCHITECTURES, LlamaForCausalLM
    from radixserve.models.loader import LoadedModel, load_model

_LAZY = {
    "ARCHITECTURES": "radixserve.models.llama",
    "LlamaForCausalLM": "radixserve.models.llama",
    "LoadedModel": "radixserve.models.loader",
    "load_model": "radixserve.models.loader",
}

__all__ = [
    "ARCHITECTURES",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelNotFoundError",
    "RopeConfig",
    "default_gguf",
    "load_model",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
