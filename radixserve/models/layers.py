"""Building blocks shared by our Llama-family models.

Numerics follow Hugging Face transformers (the test oracle): RMSNorm in fp32, rotary cos/sin
computed in fp32 and cast to the activations' dtype, `rotate_half` (non-interleaved) rotary.
Attention itself is the backend's job: the layer hands it q, k, v of the packed new tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.base import AttentionBackend
from radixserve.kernels import cpu as cpu_kernels
from radixserve.models.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), the normalisation computed in fp32.

    On the CPU one C call (radixserve/kernels) replaces the eight torch ops below.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.fuses(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual)): the residual stream's next value and its norm."""
        if cpu_kernels.fuses(x):
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions, from inverse frequencies kept in fp32.

    inv_freq is a plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round it,
    and it must survive building the model on the meta device.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.inv_freq = _inv_freq(head_dim, rope)  # [D/2] fp32, on CPU until first use

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] in `dtype`."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    # explicit device: stays real when the model is built under `torch.device("meta")`
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return inv_freq
    if rope.type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    raise NotImplementedError(f"rope type {rope.type!r} is not supported (only default and llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D], cos/sin: [T, D] -> x rotated by its token's position (rotate_half style).

    On the CPU one C call replaces the torch ops below (bit-identical for bf16)."""
    if cpu_kernels.fuses(x):
        return cpu_kernels.rotary(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if cpu_kernels.fuses(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))  # one C call on the CPU
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """q/k/v projections (fused), optional q/k norm, rotary, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.attend(*self.project(x, cos, sin), attn)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, H, D], k and v [T, Hkv, D], rotary applied."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.split_sizes[0], self.split_sizes[1]
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is None:
            # q and k heads are neighbours in qkv: one rotary call for both (half the small ops)
            qk = apply_rotary(qkv[:, : q_size + kv_size].view(t, -1, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        else:
            q = self.q_norm(qkv[:, :q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Store k, v, attend with q, project: [T, hidden]."""
        out = attn.forward(q, k, v, self.layer_id)  # [T, H, D]
        return self.o_proj(out.reshape(q.shape[0], -1))
