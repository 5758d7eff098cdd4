"""A GGUF model's linear layers and embedding served from the file's quantized blocks
(`--quantization gguf`, the default for a GGUF model on the CPU).

People who serve models on CPUs serve quantized GGUF files. Dequantized to bf16, a Q4 file
takes 3.5x its size in memory and every decode step reads 3.5x the bytes; kept as blocks,
a decode step reads what the file holds (radixserve.kernels.quant_linear: dot products that
dequantize inside, over activations quantized per row to int8 blocks, as llama.cpp computes;
Q8_0's to int16 blocks, so that its greedy output is the dequantized model's).
A forward of WIDEN_ROWS rows or more (a prefill chunk) instead widens each weight once and
multiplies densely in the model's dtype: there the arithmetic, not the weight bytes, sets the
pace. Except for the formats whose integer kernels outrun that dense matmul on this ISA tier
(`prefills_on_kernels`: the 4-bit formats on AVX2, where the dense matmul is fp32), which stay on
the kernels at any row count. A row's output is the same whatever batch it is in, as long as
the batch stays on one side of WIDEN_ROWS (speculation's checks and decode batches below it,
prefill chunks above).

What is read from the file, by the GGUF's tensor names (`blk.N.attn_q.weight`, ...):
- each linear layer's weight whose type the kernels serve (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K);
  a fused layer (q/k/v, gate/up) is its parts side by side, each in its own type (a Q4_K_M
  file keeps v in Q6_K beside q and k in Q4_K), one kernel call per run of one type;
- the token embedding, if its type is served: looked-up rows are dequantized as they are used;
  a tied LM head reads the same blocks (one copy), and writes fp32 logits.
Everything else (norms, biases, a layer of a type the kernels do not serve) the loader reads
from the file dequantized (models/gguf_weights.py), and logs which layers those are.

llama.cpp's converter stores a llama model's q and k rows permuted per head (its rotary pairs
dimensions (2i, 2i+1), HF's pairs (i, i + d/2)); transformers undoes it when it dequantizes,
and so does this module, moving whole rows of blocks (a block never spans two rows;
gguf_weights.hf_row_order).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import isa
from radixserve.kernels import quant_linear as qk
from radixserve.kernels.quant_linear import QuantType
from radixserve.models.config import ModelConfig
from radixserve.models.gguf_index import GGUFIndex
from radixserve.models.gguf_weights import LINEAR_PARTS, hf_row_order, permuted_heads
from radixserve.models.packed_linear import onednn_packs

# a forward of this many rows or more (a prefill chunk) widens the weight once and multiplies
# densely: the quantized kernels' integer dot products win while few rows share each weight
# block read, a dense matmul once many do (docs/models.md). Above the default
# --max-running-requests, so every decode batch stays on the kernels.
WIDEN_ROWS = 128
# the formats whose kernels beat widening at any row count, per ISA tier: on AVX2 (no fast bf16
# matmul, so widening means fp32 FMAs) the 4-bit formats' byte products, summed in int16, beat
# the widened weight's matmul at prefill sizes; Q8_0's and Q6_K's do not (the measurements are
# in docs/models.md)
_KERNEL_PREFILL = {isa.Tier.AVX2: frozenset({"Q4_0", "Q4_1", "Q4_K"})}


@dataclass(frozen=True)
class QuantizedPart:
    """One GGUF tensor's blocks as the kernel reads them: `out_features` rows."""

    qtype: QuantType
    out_features: int
    packed: torch.Tensor  # uint8, the kernel's layout (quant_linear.pack_quantized)


class QuantizedLinear(nn.Module):
    """y = x @ W.T + b with W kept as GGUF blocks: parts side by side along the outputs."""

    def __init__(self, in_features: int, parts: list[QuantizedPart], bias: bool,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.parts = [(p.qtype, p.out_features) for p in parts]
        for i, part in enumerate(parts):  # buffers: counted by model.buffers(), not in the state dict
            self.register_buffer(f"blocks_{i}", part.packed, persistent=False)
        # filled from the file by the loader (models/gguf_weights.py; GGUF biases are not quantized)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.out_dtype = out_dtype

    def _blocks(self) -> Iterator[tuple[QuantType, int, torch.Tensor]]:
        for i, (qtype, rows) in enumerate(self.parts):
            yield qtype, rows, getattr(self, f"blocks_{i}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self._blocks())
        widen = x.numel() // self.in_features >= WIDEN_ROWS
        if widen and not any(prefills_on_kernels(qtype) for qtype, _, _ in parts):
            return self._widened(x, parts, self.bias)
        outs, start = [], 0
        for qtype, rows, blocks in parts:
            bias = None if self.bias is None else self.bias[start : start + rows]
            if widen and not prefills_on_kernels(qtype):
                outs.append(self._widened(x, [(qtype, rows, blocks)], bias))
            else:
                outs.append(qk.quant_linear(x, blocks, qtype, self.in_features, rows,
                                            None if bias is None else bias.float(), self.out_dtype))
            start += rows
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _widened(self, x: torch.Tensor, parts: list[tuple[QuantType, int, torch.Tensor]],
                 bias: torch.Tensor | None) -> torch.Tensor:
        """A prefill chunk: these parts' weights widened once for all its rows, then one dense
        matmul (bf16 where torch multiplies bf16 fast, from the avx512 tier up; fp32 below)."""
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 and onednn_packs() else torch.float32
        weight = _widening_buffer(sum(rows for _, rows, _ in parts), self.in_features, dtype)
        start = 0
        for qtype, rows, blocks in parts:
            qk.dequantize_to(blocks, qtype, self.in_features, dtype, out=weight[start : start + rows])
            start += rows
        out = F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype))
        return out.to(self.out_dtype or x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] fp32: what the blocks hold (tests compare it with the dequantized folder)."""
        return torch.cat([qk.dequantize(b, qtype, self.in_features) for qtype, _, b in self._blocks()])

    def extra_repr(self) -> str:
        kinds = "+".join(f"{q.name}x{rows}" for q, rows in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features} ({kinds}), bias={self.bias is not None}"


def prefills_on_kernels(qtype: QuantType) -> bool:
    """Whether a prefill chunk (WIDEN_ROWS rows or more) of this format stays on the quantized
    kernels at this ISA tier, rather than widening the weight."""
    return qtype.name in _KERNEL_PREFILL.get(isa.selected_tier(), frozenset())


# one widened weight per (rows, cols, dtype), shared by every layer of that shape: first touching
# a fresh tensor that size costs more than the widening itself, and one layer runs at a time
_WIDENED: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def _widening_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    key = (rows, cols, dtype)
    if key not in _WIDENED:
        _WIDENED[key] = torch.empty(rows, cols, dtype=dtype)
    return _WIDENED[key]


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks; a lookup dequantizes only the rows it reads."""

    def __init__(self, part: QuantizedPart, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = part.out_features, embedding_dim, part.qtype
        self.register_buffer("blocks", part.packed, persistent=False)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        widened = self.dtype if self.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = qk.dequantize_to(self.blocks, self.qtype, self.embedding_dim, widened, rows=input_ids)
        return out.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} ({self.qtype.name})"


@dataclass
class QuantizedLoad:
    """What `quantize_from_gguf` replaced, for the loader's log and /server_info."""

    modules: dict[str, nn.Module]  # our module path -> its quantized replacement
    types: dict[str, int]  # GGUF type name -> how many tensors are served quantized
    dequantized: dict[str, list[str]]  # GGUF type name -> the tensors left to the dequantized path

    @property
    def weight_format(self) -> str:
        """`gguf Q4_1+Q8_0` (the types served quantized, most tensors first), or `none`."""
        if not self.types:
            return "none"
        return "gguf " + "+".join(sorted(self.types, key=lambda t: (-self.types[t], t)))


class _GGUFFile:
    """The tensors of one GGUF file by name, with what the kernels need to know of each."""

    def __init__(self, index: GGUFIndex) -> None:
        self.index = index
        self.path = index.path
        self.tensors = index.tensors

    def blocks(self, name: str, rows: int, cols: int, permute_heads: int | None = None) -> tuple[QuantType, np.ndarray] | None:
        """The tensor `name` as its type and a copy of its blocks [rows, bytes a row], or None if
        its type is not served. Raises ValueError if it is absent or its shape is not
        [rows, cols] (the config's)."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.path}: tensor {name} is missing")
        shape = (tensor.dims[1] if len(tensor.dims) > 1 else 1, tensor.dims[0])  # ggml: [cols, rows]
        if shape != (rows, cols):
            raise ValueError(f"{self.path}: tensor {name} has shape {shape}, the config implies {(rows, cols)}")
        qtype = qk.quant_type_of(tensor.type)
        if qtype is None or not qk.quant_linear_serves(qtype, cols):
            return None
        blocks = self.index.rows(name).reshape(rows, -1)
        if blocks.shape[1] != qk.row_bytes(qtype, cols):
            raise ValueError(f"{self.path}: tensor {name} holds {blocks.shape[1]} bytes a row, "
                             f"{qtype.name} of {cols} values takes {qk.row_bytes(qtype, cols)}")
        if permute_heads is not None:  # llama.cpp's rotary order -> HF's, whole rows
            blocks = hf_row_order(blocks, permute_heads)
        return qtype, np.array(blocks)  # a copy: resident, not a view of the mapped file

    def type_name(self, name: str) -> str:
        return self.tensors[name].type_name


def quantize_from_gguf(model: nn.Module, config: ModelConfig, index: GGUFIndex, dtype: torch.dtype) -> QuantizedLoad:
    """Replace `model`'s linear layers (and embedding) whose tensors in the GGUF file `index`
    the kernels serve with quantized modules, in place; the model may still be on the meta
    device. The loader then reads what is left (norms, biases, unserved layers) from the same
    index: models/gguf_weights.py."""
    f = _GGUFFile(index)
    c = config
    out_sizes = {"attn_q": c.num_heads * c.head_dim, "attn_k": c.num_kv_heads * c.head_dim,
                 "attn_v": c.num_kv_heads * c.head_dim, "attn_output": c.hidden_size,
                 "ffn_gate": c.intermediate_size, "ffn_up": c.intermediate_size, "ffn_down": c.hidden_size}
    in_sizes = {"attn_output": c.num_heads * c.head_dim, "ffn_down": c.intermediate_size}
    heads = permuted_heads(f.index, c)
    load = QuantizedLoad({}, {}, {})

    def served(names: list[str], rows: list[int], cols: int, permute_heads: list[int | None]) -> list[QuantizedPart] | None:
        """The tensors `names` (one layer's parts) as runs of one type each, packed; None if a
        type is not served: a fused layer is quantized whole or not at all."""
        found = [f.blocks(n, r, cols, h) for n, r, h in zip(names, rows, permute_heads, strict=True)]
        kinds = [f.type_name(n) for n in names]
        if any(b is None for b in found):
            for n, kind in zip(names, kinds, strict=True):
                load.dequantized.setdefault(kind, []).append(n)
            return None
        for kind in kinds:
            load.types[kind] = load.types.get(kind, 0) + 1
        parts: list[QuantizedPart] = []
        for qtype, group in itertools.groupby(found, key=lambda b: b[0]):  # one kernel call a run
            blocks = np.concatenate([b for _, b in group])
            parts.append(QuantizedPart(qtype, blocks.shape[0], qk.pack_quantized(torch.from_numpy(blocks), qtype)))
        return parts

    for i, layer in enumerate(model.layers):
        for path, kinds in LINEAR_PARTS.items():
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            names = [f"blk.{i}.{k}.weight" for k in kinds]
            cols = in_sizes.get(kinds[0], c.hidden_size)
            parts = served(names, [out_sizes[k] for k in kinds], cols, [heads.get(k) for k in kinds])
            if parts is not None:
                module = QuantizedLinear(cols, parts, bias=linear.bias is not None)
                setattr(owner, attr, module)
                load.modules[f"layers.{i}.{path}"] = module
    embed = served(["token_embd.weight"], [c.vocab_size], c.hidden_size, [None])
    if embed is not None:
        model.embed_tokens = QuantizedEmbedding(embed[0], c.hidden_size, dtype)
        load.modules["embed_tokens"] = model.embed_tokens
        if c.tie_word_embeddings:  # the head reads the embedding's blocks: one copy
            model.lm_head = QuantizedLinear(c.hidden_size, embed, bias=False, out_dtype=torch.float32)
            load.modules["lm_head"] = model.lm_head
    if not c.tie_word_embeddings:
        head = served(["output.weight"], [c.vocab_size], c.hidden_size, [None])
        if head is not None:
            model.lm_head = QuantizedLinear(c.hidden_size, head, bias=False, out_dtype=torch.float32)
            load.modules["lm_head"] = model.lm_head
    return load
