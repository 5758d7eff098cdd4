"""A GGUF file's tensors dequantized, read from the file itself, under our parameter names or
under an HF checkpoint's.

- `read_from_gguf`: what a quantized load (`--quantization gguf`, models/gguf_quantized.py) does
  not keep as blocks, that is the norms, the biases and any layer of a type the kernels do not
  serve. Reading them from the file spares the model's cache entry a dequantized copy of every
  weight (models/resolve.py), 4-8x the file's size on disk.
- `hf_checkpoint`: every weight under HF's names, for the safetensors file a dequantizing load
  (`--quantization none`, a GPU) reads and a transformers reference model can load.

Each tensor is the one transformers' GGUF loader computes, bit for bit
(tests/unit/test_gguf_weights.py, tests/unit/test_models.py): the gguf package's
dequantization, and for a llama file's q and k the inverse of llama.cpp's per-head row
permutation (`hf_row_order`), which the quantized layers apply to their rows of blocks too.
Reading them here instead of through transformers' converter skips its parse of the file and
its building of the model: most of a dequantizing first load's time.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from radixserve.models.config import ModelConfig
from radixserve.models.gguf_index import GGUFIndex
from radixserve.models.llama import hf_names, model_on_meta

# GGUF architectures whose q/k rows llama.cpp's converter permuted (transformers' LlamaTensorProcessor)
_PERMUTED_ARCHITECTURES = frozenset({"llama"})
# our linear modules in a decoder layer -> the GGUF tensors each is, side by side along the
# output dimension in this order (q/k/v and gate/up are fused)
LINEAR_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
# our other modules in a decoder layer -> their GGUF tensor (blk.N.<name>)
_LAYER_MODULES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_TOP_MODULES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
_LAYER_PARAMETER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


def hf_row_order(rows: np.ndarray, heads: int) -> np.ndarray:
    """A permuted q or k tensor's rows (any trailing shape: values or bytes of blocks) in HF's
    order. llama.cpp's rotary pairs dimensions (2i, 2i+1) of a head, HF's (i, i + d/2)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def permuted_heads(index: GGUFIndex, config: ModelConfig) -> dict[str, int]:
    """The GGUF tensor kinds stored permuted (`attn_q`, `attn_k`) -> their head count; empty for an
    architecture llama.cpp stores in HF's order."""
    if index.metadata.get("general.architecture") not in _PERMUTED_ARCHITECTURES:
        return {}
    return {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}


def gguf_names(name: str) -> list[str] | None:
    """Our parameter `name` -> the GGUF tensors it is made of (several for a fused layer), or
    None for a name of no module ours and llama.cpp's llama-family files share.

    layers.3.self_attn.qkv_proj.weight -> blk.3.attn_q.weight, blk.3.attn_k.weight, blk.3.attn_v.weight
    """
    module, _, leaf = name.rpartition(".")
    if module in _TOP_MODULES:
        return [f"{_TOP_MODULES[module]}.{leaf}"]
    match = _LAYER_PARAMETER.fullmatch(name)
    if match is None:
        return None
    layer, module, leaf = match.groups()
    if module in LINEAR_PARTS:
        return [f"blk.{layer}.{part}.{leaf}" for part in LINEAR_PARTS[module]]
    return [f"blk.{layer}.{_LAYER_MODULES[module]}.{leaf}"] if module in _LAYER_MODULES else None


def read_from_gguf(index: GGUFIndex, model: nn.Module, config: ModelConfig,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`model`'s state dict (after the quantized modules replaced the layers they serve, whose
    blocks are not in it), from the file's tensors dequantized to fp32 and cast to `dtype`,
    each shape checked against the model's. Raises ValueError naming the file for a tensor
    that is missing or has the wrong shape."""
    permuted = permuted_heads(index, config)
    state = {}
    for name, param in model.state_dict().items():
        parts = _gguf_parts(index, name)
        tensors = [_read(index, part, permuted) for part in parts]
        tensor = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).to(dtype)
        if tensor.shape != param.shape:
            raise ValueError(f"{index.path}: tensor {', '.join(parts)} has shape {tuple(tensor.shape)}, "
                             f"the config implies {tuple(param.shape)} for {name}")
        state[name] = tensor
    return state


def hf_checkpoint(index: GGUFIndex, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every weight of the file's model in fp32 under an HF checkpoint's names (q, k, v and gate,
    up apart; no `lm_head` for tied embeddings): the state dict transformers' GGUF conversion
    gives. Raises ValueError naming the file for an unsupported architecture or a missing
    tensor; shapes are checked when a load reads the checkpoint."""
    model = model_on_meta(config, index.path)
    permuted = permuted_heads(index, config)
    return {hf: _read(index, part, permuted)
            for name in model.state_dict()
            for hf, part in zip(hf_names(name), _gguf_parts(index, name), strict=True)}


def _gguf_parts(index: GGUFIndex, name: str) -> list[str]:
    parts = gguf_names(name)
    if parts is None:
        raise ValueError(f"{index.path}: no GGUF tensor name is known for {name}")
    for part in parts:
        if part not in index.tensors:
            raise ValueError(f"{index.path}: tensor {part} is missing")
    return parts


def _read(index: GGUFIndex, part: str, permuted: dict[str, int]) -> torch.Tensor:
    """One GGUF tensor dequantized to fp32, its rows in HF's order."""
    values = index.values(part)
    kind = part.split(".")[-2]
    return torch.from_numpy(hf_row_order(values, permuted[kind]) if kind in permuted else values)
