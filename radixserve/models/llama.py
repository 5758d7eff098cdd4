"""The Llama family as one model: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3.

They differ only in flags of `ModelConfig` (qkv bias, q/k norm, rope scaling, tied embeddings),
so one class serves them all. Every forward works on the packed new tokens of a whole batch,
[T] ids and positions, with no batch dimension; the attention backend knows which request each
token belongs to and where its cached keys/values live.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.base import AttentionBackend, AttentionShape
from radixserve.models.config import ModelConfig
from radixserve.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)).

    The block's last residual add is left to the next block's input norm (one fused add + norm
    call instead of an add and a norm): a layer takes and returns (output, residual), and the
    residual stream is output + residual."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (with residual None: the stream itself) -> (mlp output, residual)."""
        residual, q, k, v = self.project(x, residual, cos, sin)
        return self.attend(q, k, v, residual, attn)

    def project(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's first half: (the residual stream, q, k, v after rotary). A blend reads
        every token's k, v here but attends with a few (worker/blend.py)."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            residual, normed = self.input_layernorm.add_and_norm(x, residual)
        q, k, v = self.self_attn.project(normed, cos, sin)
        return residual, q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor, attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's second half, from `project`'s outputs: attention, then the MLP."""
        attn_out = self.self_attn.attend(q, k, v, attn)  # [T, hidden]
        residual, normed = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; parameter names follow HF's minus the `model.` prefix, with
    q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj` (the loader concatenates them)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # weights come from the checkpoint: skip nn.Embedding's random init (on the meta device
        # it would import torch._refs, about a second of every load)
        embed = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64, all requests' new tokens packed, in the order of the
        batch `attn` was planned for. Returns hidden states [T, hidden] after the final norm."""
        h, cos, sin = self.embed(input_ids, positions)
        h, residual = self.run_layers(h, None, cos, sin, attn, 0, len(self.layers))
        return self.final_norm(h, residual)

    # The parts of `forward`, for callers that run some layers over a subset of the tokens (a
    # segment blend's selective recompute, worker/blend.py): layers [0, k) over all of them,
    # then [k, L) over the rows kept of h, residual, cos and sin, with a plan for those rows.

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T] ids and positions -> (embeddings [T, hidden], cos, sin [T, D], shared by all layers)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        return h, cos, sin

    def run_layers(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        attn: AttentionBackend, start: int, stop: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers start .. stop - 1 over the planned tokens: (h, residual) as the last one left
        them (the residual stream is their sum; residual None before layer 0)."""
        for layer in self.layers[start:stop]:
            h, residual = layer(h, residual, cos, sin, attn)
        return h, residual

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last layer, normed: the hidden states logits read."""
        return self.norm.add_and_norm(h, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits; call it only on the rows to be sampled."""
        if self.lm_head is not None:  # untied, or a packed copy of the tied embedding
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def attention_shape(self) -> AttentionShape:
        c = self.config
        return AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, scale=c.head_dim**-0.5)


# HF `architectures` string -> model class
ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_on_meta(config: ModelConfig, source: Path) -> LlamaForCausalLM:
    """`config`'s model on the meta device (no memory, no random init), for a load to assign
    weights into. Raises ValueError naming `source` for an architecture not in ARCHITECTURES."""
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"{source}: architecture {config.architecture} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    with torch.device("meta"):
        return ARCHITECTURES[config.architecture](config)

# our fused modules -> the HF modules each concatenates (along dim 0, in this order)
_HF_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def hf_names(name: str) -> list[str]:
    """Our parameter name -> the tensors of an HF checkpoint it is made of, in order.

    layers.3.self_attn.qkv_proj.weight -> model.layers.3.self_attn.{q,k,v}_proj.weight
    """
    hf = name if name.startswith("lm_head.") else f"model.{name}"
    module, _, leaf = hf.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in _HF_FUSED:
        return [f"{parent}.{part}.{leaf}" for part in _HF_FUSED[last]]
    return [hf]
