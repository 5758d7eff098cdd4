"""Shared fixtures: tiny random Hugging Face checkpoints, servers started on them, and the default
model's folder.

torch, transformers and the HTTP helpers are imported inside the functions, so test files that
need none of them (the pure-Python cache and scheduler tests) do not pay for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from radixserve.kernels import isa

if TYPE_CHECKING:
    import torch
    from http_helpers import Server
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--emulate-avx512", action="store_true",
                     help="run the kernels' avx512 and avx512_bf16 tiers on SIMDe-emulated builds, on any "
                          "x86 CPU (tests/emulated_avx512.py; `make test-emulated`)")


def pytest_configure(config: pytest.Config) -> None:
    """Select the CPU ISA tier before any test touches torch: RADIXSERVE_CPU_ISA=avx2 (say) runs
    the whole suite as on an AVX2 machine, torch's own kernels capped too (kernels/isa.py).
    With --emulate-avx512, the AVX-512 tiers run on emulated builds instead."""
    isa.selected_tier()
    if config.getoption("--emulate-avx512"):
        import emulated_avx512

        emulated_avx512.install()


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
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model(seed=0, **config_overrides) -> folder`: a 2-layer random Llama with the default
    model's real tokenizer (`runtime_helpers.make_tiny_chat_model`), built once per session for
    each distinct set of arguments and shared by every module that asks: never write into it."""
    built: dict[tuple[int, tuple[tuple[str, Any], ...]], Path] = {}

    def get(seed: int = 0, **config_overrides: Any) -> Path:
        from runtime_helpers import make_tiny_chat_model

        key = (seed, tuple(sorted(config_overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp("tiny_model") / "model"
            built[key] = make_tiny_chat_model(folder, seed, **config_overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tiny_model: Callable[..., Path]) -> Path:
    """The tiny chat model with default settings: what most server and Engine tests run on."""
    return tiny_model()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """`start_server(model, *options) -> Server`: `radixserve serve` on a free loopback port
    (`http_helpers.running_server`), healthy when returned; `server.url` is its base URL. Each
    server lives to the end of the module, so a module's tests share it (a start is the suite's
    main cost); then each must stop cleanly (exit code 0), else the teardown fails with its log."""
    from http_helpers import running_server

    with ExitStack() as servers:

        def start(model: Path | str, *options: str) -> Server:
            log_dir = tmp_path_factory.mktemp("server")
            return servers.enter_context(running_server(model, *options, log_dir=log_dir))

        yield start


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
