"""Load a model spec into our own model, reading safetensors directly (no transformers).

The model is built on the meta device (no memory, no random init) and the checkpoint tensors
are assigned into it, cast to the requested dtype and moved to the device once each. A GGUF
model on the CPU first has its linear layers and embedding replaced by ones that keep the
file's quantized blocks (models/gguf_quantized.py, `quantization="gguf"`); the rest it reads
from the file too (models/gguf_weights.py), so its converted folder holds only the config and
tokenizer. Otherwise the tensors come from the folder a GGUF was dequantized into.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from radixserve.config import QUANTIZATIONS
from radixserve.models.config import ModelConfig
from radixserve.models.gguf_index import GGUFIndex
from radixserve.models.gguf_quantized import quantize_from_gguf
from radixserve.models.gguf_weights import read_from_gguf
from radixserve.models.llama import LlamaForCausalLM, hf_names, model_on_meta
from radixserve.models.packed_linear import fp32_logits_head, pack_linears, packed_linear
from radixserve.models.resolve import gguf_file, resolve_model

# checkpoint tensors we recompute ourselves
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

log = logging.getLogger("radixserve.worker")


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    path: Path  # the HF folder; the tokenizer files live here
    # how the weights are held: "gguf Q4_1+Q8_0" (the GGUF types kept quantized), or "none"
    # (dequantized to the model's dtype)
    weight_format: str = "none"


def load_model(
    spec: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    pack_weights: bool = True,
    quantization: str = "gguf",
) -> LoadedModel:
    """Resolve `spec` (see resolve.py), build the model and load its weights.

    dtype None keeps the checkpoint's dtype. Linear weights on the CPU are packed for its matmul
    kernels (packed_linear.py) unless `pack_weights` is False; with `quantization` "gguf" (and
    packing on), a GGUF model's layers of a type the kernels serve keep the file's blocks.
    Raises ModelNotFoundError or ValueError naming the path for a missing or unusable model,
    including missing or unexpected weights and tensors that disagree with the config.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    source = gguf_file(spec)
    quantize = source is not None and quantization == "gguf" and pack_weights
    if quantize and torch.device(device).type != "cpu":
        log.info("%s: quantized kernels are CPU-only; dequantizing to %s on %s", source.name, dtype or "float32", device)
        quantize = False
    # a quantized load reads every tensor from the GGUF: its folder needs no dequantized weights
    path = resolve_model(spec, weights=not quantize)
    config = ModelConfig.from_folder(path)
    model = model_on_meta(config, path)
    dtype = dtype or config.torch_dtype
    weight_format = "none"
    if quantize:
        index = GGUFIndex(source)  # read once, for the blocks and for the rest
        quantized = quantize_from_gguf(model, config, index, dtype)
        weight_format = quantized.weight_format
        for kind, names in sorted(quantized.dequantized.items()):
            log.info("%s: %d tensors of type %s have no quantized kernel; dequantized to %s (e.g. %s)",
                     source.name, len(names), kind, dtype, names[0])
        state = read_from_gguf(index, model, config, dtype)
    else:
        state = _read_weights(path, model, dtype, torch.device(device))
    model.load_state_dict(state, assign=True)
    if pack_weights:
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        if isinstance(head, nn.Embedding | nn.Linear) and (
            fp32_head := fp32_logits_head(head.weight, getattr(head, "bias", None))
        ) is not None:
            model.lm_head = fp32_head  # not an nn.Linear: pack_linears leaves it
        pack_linears(model)
        if model.lm_head is None:  # tied: a packed copy of the embedding table, where one applies
            model.lm_head = packed_linear(model.embed_tokens.weight, None)
    return LoadedModel(model.eval().requires_grad_(False), config, path, weight_format)


def _read_weights(path: Path, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Our state dict from the folder's safetensors files; every tensor checked by name and shape."""
    with ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(f, framework="pt", device="cpu"))
            for f in sorted(path.glob("*.safetensors"))
        ]
        where = {name: f for f in files for name in f.keys()}  # HF name -> open file
        state, missing, used = {}, [], set()
        for name, param in model.state_dict().items():
            parts = hf_names(name)
            absent = [p for p in parts if p not in where]
            if absent:
                missing += absent
                continue
            tensors = [where[p].get_tensor(p).to(device, dtype) for p in parts]
            tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{path}: weight {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(param.shape)}"
                )
            state[name] = tensor
            used.update(parts)
    if model.config.tie_word_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    unexpected = sorted(n for n in where if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match {model.config.architecture}: "
            f"missing {_preview(missing)}, unexpected {_preview(unexpected)}"
        )
    return state


def _preview(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}" if names else "none"
