"""Shared fixtures: tiny random Hugging Face checkpoints and the default model's folder.

torch and transformers are imported inside the functions, so test files that need neither (the
pure-Python cache and scheduler tests) do not pay for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from radixserve.kernels import isa

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def pytest_configure(config: pytest.Config) -> None:
    """Select the CPU ISA tier before any test touches torch: RADIXSERVE_CPU_ISA=avx2 (say) runs
    the whole suite as on an AVX2 machine, torch's own kernels capped too (kernels/isa.py)."""
    isa.selected_tier()


@pytest.fixture(params=list(isa.Tier), ids=str)
def cpu_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> isa.Tier:
    """Each ISA tier in turn as the tier in use (the kernels built for it, and every choice that
    asks `isa.selected_tier()`); tiers above the one in use are skipped, saying why."""
    tier = request.param
    if tier > isa.selected_tier():
        pytest.skip(f"the tier in use here is {isa.selected_tier()}: it cannot run {tier}")
    monkeypatch.setattr(isa, "selected_tier", lambda: tier)
    return tier


def tiny_configs() -> dict[str, PretrainedConfig]:
    """One small config per supported feature; keys name the case in test ids."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**_TINY, num_key_value_heads=4),
        "llama_gqa_tied": LlamaConfig(**_TINY, num_key_value_heads=2, tie_word_embeddings=True),
        "llama3_rope": LlamaConfig(
            **_TINY,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # small, so short test prompts cross all three frequency bands
                "original_max_position_embeddings": 32,
            },
        ),
        "mistral": MistralConfig(**_TINY, num_key_value_heads=2, head_dim=16, sliding_window=None),
        "qwen2": Qwen2Config(**_TINY, num_key_value_heads=2),
        "qwen3": Qwen3Config(**_TINY, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF's init leaves biases at 0 and norms at 1, which would hide bugs in both; logits of
    order 1-10 make the comparison meaningful."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)


def save_tiny_model(config: PretrainedConfig, path: Path, seed: int = 0) -> Path:
    """Build a random fp32 model from `config` and save it as a HF folder (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> HF folder of a tiny random model (see `tiny_configs`)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        name: save_tiny_model(config, root / name, seed=i)
        for i, (name, config) in enumerate(tiny_configs().items())
    }


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's HF folder, converted into the real cache ($RADIXSERVE_CACHE or
    ~/.cache/radixserve) so a machine pays the conversion once, not once per test run."""
    from radixserve.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def smol() -> Any:
    """The default model's tokenizer (SmolLM2), as transformers reads it from the shipped GGUF."""
    from transformers import AutoTokenizer

    from radixserve.models import default_gguf

    gguf = default_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def hf_default_model() -> torch.nn.Module:
    """transformers' own reading of the default GGUF (fp32): the oracle for our conversion."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixserve.models import default_gguf

    gguf = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()
