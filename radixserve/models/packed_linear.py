"""bf16 linear layers with weights prepacked for oneDNN (the CPU's AMX/AVX-512 kernels).

A plain bf16 `F.linear` on the CPU hands oneDNN a row-major weight, which it reorders into its
blocked layout on every call: at decode batch sizes that reorder is a large part of each
matmul. Packing once at load time removes it (bench/model_runner.py measures the step); the
results are bit-identical to `F.linear` (tests/test_packed_linear.py).

Only bf16 on the CPU is packed: fp32 keeps `F.linear`, whose results the exactness tests compare
with transformers', and CUDA has its own kernels.
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its blocked layout for this many rows; it serves any row count
PACK_BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's packed layout (not a readable tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` of `model` by a `PackedLinear`; returns how many."""
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child.weight):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                packed += 1
    return packed
