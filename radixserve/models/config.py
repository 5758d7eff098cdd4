"""The model facts radixserve needs, read once from a Hugging Face config.json.

Our own frozen dataclass, so the rest of the runtime never depends on transformers' config
classes (whose fields move between versions: v4 `rope_theta` + `rope_scaling`, v5
`rope_parameters`). This module does not import torch, so any process can read a ModelConfig.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# model_type -> architecture, for configs saved without an "architectures" list
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `type` other than default/llama3 is kept so the model can
    refuse it by name."""

    theta: float = 10000.0
    type: str = "default"
    # llama3 scaling only
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder, plus the token ids serving needs."""

    architecture: str  # HF architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    # The longest context served exactly: HF's max_position_embeddings, capped at the sliding
    # window when the checkpoint uses one (within the window full attention is identical).
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool  # bias on the attention output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, merged
    dtype: str = "float32"  # dtype of the checkpoint's weights, e.g. "bfloat16"

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"checkpoint dtype {self.dtype!r} is not one of {_DTYPES}")

    @property
    def context_token_cost(self) -> float:
        """A token's attention work per token of context, as a share of its work in a layer's
        linear projections (multiply-adds: q/k/v/o and the gated MLP; QK^T and PV take
        2 * heads * head_dim per context token). The scheduler budgets prefill chunks with it:
        deep in a long context a chunk's attention outweighs its projections."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        linear = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        return 2 * q / linear

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_folder(cls, path: Path) -> ModelConfig:
        """Read config.json (and generation_config.json, if present) from a HF model folder."""
        config = _read_json(path / "config.json")
        gen_path = path / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.exists() else None
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a config.json dict (v4 or v5 layout); raises ValueError for what we can't run."""
        architecture = _architecture(cfg)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{architecture}: hidden_act {act!r} is not supported (only silu)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_mistral = architecture == "MistralForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope(cfg),
            max_position_embeddings=_context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or (attention_bias and not is_mistral),
            o_proj_bias=attention_bias and not (is_qwen2 or is_mistral),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg, generation or {}),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {path}: {e}") from e


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    if model_type not in _ARCH_BY_MODEL_TYPE:
        raise ValueError(f"config has no 'architectures' and an unknown model_type {model_type!r}")
    return _ARCH_BY_MODEL_TYPE[model_type]


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    """v5 keeps everything in `rope_parameters`; v4 has `rope_theta` and `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "llama3":
        return RopeConfig(theta=theta, type=rope_type)
    try:
        return RopeConfig(
            theta=theta,
            type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
            ),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing {e.args[0]!r}: {params}") from e


def _context_length(cfg: dict[str, Any]) -> int:
    length = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    if window and uses_window:
        length = min(length, window)
    return length


def _eos_ids(cfg: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and i not in ids:
                ids.append(i)
    return tuple(ids)
