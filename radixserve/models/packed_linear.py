"""Linear layers with weights packed once, at load, for the CPU's matmul kernels.

A plain `F.linear` on the CPU hands the matmul library nn.Linear's row-major weight, which it
reorders into its own blocked layout on every call: at decode batch sizes that reorder costs
more than the arithmetic. Packing once removes it (bench/model_runner.py measures the step):

- column panels for radixserve's own kernel (`radixserve.kernels.cpu.linear`): fp32 always, and
  bf16 from the avx2 ISA tier up but for AMX (kernels/isa.py); the same dot products summed in
  another order than MKL's and oneDNN's, so equal to `F.linear` to a few fp32 ulps (bf16:
  before the rounding).
- bf16 on the AMX tier (or an odd input size from the avx512 tier up): oneDNN's packed layout,
  for its AMX kernels; bit-identical to `F.linear`.

The packed weight replaces the original (no second copy), except for a tied LM head, whose
weight is also the embedding table. CUDA keeps nn.Linear: its kernels read the weight as is.

A bf16 LM head is the panel kernel's wherever it builds bf16 (on the AMX tier too), giving the
fp32 sums as logits (`fp32_logits_head`): rounded to bf16, logits of 16 to 32 are 1/8 apart, so
near-ties become exact ties and greedy decoding takes the lower token id, not the likelier one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa

log = logging.getLogger("radixserve.worker")

# oneDNN picks its blocked layout for this many rows; it serves any row count
PACK_BATCH_HINT = 32


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in a packed layout (not a readable [N, K] tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class OneDNNLinear(PackedLinear):
    """bf16 on the AMX tier: oneDNN's packed weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PanelLinear(PackedLinear):
    """fp32, bf16 below the AMX tier, and a bf16 LM head on every tier that builds bf16: column
    panels for radixserve's CPU kernel. Outputs are in the weight's dtype, or fp32 with
    `out_dtype` (bf16 inputs' sums unrounded)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__(weight, bias)
        self.panels = cpu_kernels.pack_linear(weight)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x, self.panels, self.bias, self.in_features, self.out_features, self.out_dtype)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """The packed form of a linear layer's weight here, or None where none applies."""
    if weight.device.type != "cpu":
        return None
    if cpu_kernels.linear_serves(weight.dtype, weight.shape[1]):
        return PanelLinear(weight, bias)
    if weight.dtype == torch.bfloat16 and onednn_packs():
        try:
            return OneDNNLinear(weight, bias)
        except RuntimeError as exc:  # e.g. ONEDNN_MAX_CPU_ISA set below AVX-512 by the user
            _onednn_refused(exc)
    return None


def fp32_logits_head(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PanelLinear | None:
    """The LM head of a bf16 CPU model as the panel kernel's fp32 sums, wherever the kernel
    builds bf16 (see the module docstring); None elsewhere, where the head packs as any linear."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not cpu_kernels.linear_builds(weight.dtype, weight.shape[1]):
        return None
    return PanelLinear(weight, bias, out_dtype=torch.float32)


def _onednn_refused(exc: RuntimeError) -> None:
    """Say once that oneDNN would not pack, and stop asking it: nn.Linear stays, slower."""
    global _ONEDNN_REFUSED
    _ONEDNN_REFUSED = True
    log.warning("oneDNN refused to pack bf16 weights (%s); linear layers stay unpacked", exc)


_ONEDNN_REFUSED = False


def onednn_packs() -> bool:
    """oneDNN packs bf16 weights from the avx512 tier up (below it torch refuses: its bf16 path
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return (not _ONEDNN_REFUSED and isa.at_least(isa.Tier.AVX512) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` that has a packed form here; returns how many."""
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (replacement := packed_linear(child.weight, child.bias)):
                setattr(module, name, replacement)
                packed += 1
    return packed
