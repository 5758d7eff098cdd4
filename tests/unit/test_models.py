"""Our models against Hugging Face transformers on the same weights (fp32), through the paged
attention backend, plus the config parser and the loader's errors.

On the CPU our fp32 linears (radixserve/kernels: weights in column panels) and, at head size
64, our prefill attention kernel sum the same products in another order than MKL and torch's
flash attention: the default model's logits (up to 38) differ from HF's by ~1.6e-4 (torch 2.13,
transformers 5.24); the greedy token is the same at every position.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model, tiny_configs
from paged_run import PagedRun
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.kernels import isa
from radixserve.models import LlamaForCausalLM, ModelConfig, load_model, resolve
from radixserve.models.layers import RotaryEmbedding

TINY_TOL = 1e-4  # fp32, 2 layers
DEFAULT_TOL = 1e-3  # fp32, 30 layers, logits of order 10


@torch.inference_mode()
def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    diff = (ours - ref).abs().max().item()
    assert diff < tol, f"max abs diff {diff:.3g} >= {tol}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    return diff


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = list(tiny_configs())


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_match_hf(tiny_model_dirs: dict[str, Path], case: str) -> None:
    path = tiny_model_dirs[case]
    ours = load_model(path, torch.float32).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt(40, ours.config.vocab_size, seed=1)
    run = PagedRun(ours)
    logits = run.forward({run.add_request(): ids})[0]
    assert logits.dtype == torch.float32
    assert_close(logits, hf_logits(hf, ids), TINY_TOL)


@pytest.mark.parametrize("case", CASES)
def test_chunks_decode_and_packed_batch_match_hf(
    tiny_model_dirs: dict[str, Path], case: str, cpu_tier: isa.Tier
) -> None:
    """Two requests share forwards: prefill chunks over cached pages, then decode steps packed
    together, on scattered pages of size 4 (several tokens straddle page borders); with the
    kernels of every CPU ISA tier the machine supports."""
    path = tiny_model_dirs[case]
    ours = load_model(path, torch.float32).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a, b = _prompt(30, ours.config.vocab_size, seed=2), _prompt(23, ours.config.vocab_size, seed=3)
    run = PagedRun(ours, page_size=4)
    ra, rb = run.add_request(), run.add_request()
    got: dict[int, list[torch.Tensor]] = {ra: [], rb: []}
    steps = [
        {ra: a[:13]},  # first chunk of a
        {ra: a[13:25], rb: b[:18]},  # a's second chunk (over cached pages) packed with b's prefill
        *({ra: [a[i]], rb: [b[18 + i - 25]]} for i in range(25, 30)),  # decode both
    ]
    for step in steps:
        for r, logits in run.forward(step).items():
            got[r].append(logits)
    assert_close(torch.cat(got[ra]), hf_logits(hf, a), TINY_TOL)
    assert_close(torch.cat(got[rb]), hf_logits(hf, b), TINY_TOL)


def test_bfloat16_runs_close_to_hf(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["qwen3"]
    ours = load_model(path, torch.bfloat16).model
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.rotary.inv_freq.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = _prompt(24, ours.config.vocab_size, seed=4)
    run = PagedRun(ours)
    logits = run.forward({run.add_request(): ids})[0]
    diff = (logits - hf_logits(hf, ids)).abs().max().item()
    assert diff < 0.1, diff  # bf16 has 8 mantissa bits; logits here are of order 1


def test_llama3_inv_freq_matches_hf() -> None:
    hf_config = tiny_configs()["llama3_rope"]
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    config = ModelConfig.from_dict(hf_config.to_dict())
    ours = RotaryEmbedding(config.head_dim, config.rope).inv_freq
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    plain = RotaryEmbedding(config.head_dim, replace(config.rope, type="default"))
    assert not torch.equal(ours, plain.inv_freq)  # the scaling does change frequencies


def test_config_reads_v4_layout_and_merges_eos() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }
    config = ModelConfig.from_dict(cfg, {"eos_token_id": [128001, 128008, 128009]})
    assert config.rope.theta == 500000.0 and config.rope.type == "llama3"
    assert config.rope.original_max_position_embeddings == 8192
    assert config.head_dim == 128 and config.num_kv_heads == 8
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.torch_dtype == torch.bfloat16
    assert not (config.attention_bias or config.o_proj_bias or config.qk_norm)


def test_config_flags_per_architecture() -> None:
    configs = {name: ModelConfig.from_dict(c.to_dict()) for name, c in tiny_configs().items()}
    assert configs["qwen2"].attention_bias and not configs["qwen2"].o_proj_bias
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32
    assert configs["llama_gqa_tied"].tie_word_embeddings
    assert configs["llama_gqa_tied"].num_kv_heads == 2
    windowed = tiny_configs()["mistral"].to_dict() | {"sliding_window": 128}
    assert ModelConfig.from_dict(windowed).max_position_embeddings == 128


def test_config_rejects_what_we_cannot_run() -> None:
    base = tiny_configs()["llama"].to_dict()
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 3"):
        ModelConfig.from_dict(base | {"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="float8"):
        ModelConfig.from_dict(base | {"dtype": "float8"})
    with pytest.raises(ValueError, match="gelu"):
        ModelConfig.from_dict(base | {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_dict(base | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    yarn = ModelConfig.from_dict(base | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(NotImplementedError, match="yarn"):
        LlamaForCausalLM(yarn)


def _copy_tiny(tmp_path: Path, case: str = "llama") -> Path:
    return save_tiny_model(tiny_configs()[case], tmp_path / case)


def test_loader_names_missing_and_unexpected_weights(tmp_path: Path) -> None:
    path = _copy_tiny(tmp_path)
    weights = path / "model.safetensors"
    state = load_file(weights)
    state["model.layers.0.self_attn.extra.weight"] = state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, weights)
    with pytest.raises(
        ValueError, match=r"missing.*layers\.1\.mlp\.up_proj.*unexpected.*extra"
    ) as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_loader_rejects_shape_mismatch_and_unknown_architecture(tmp_path: Path) -> None:
    path = _copy_tiny(tmp_path)
    config_file = path / "config.json"
    cfg = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(cfg | {"intermediate_size": 96}))
    with pytest.raises(ValueError, match="gate_up_proj.weight has shape"):
        load_model(path)
    config_file.write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported"):
        load_model(path)


def test_loader_ignores_stored_copy_of_tied_head(tmp_path: Path) -> None:
    path = _copy_tiny(tmp_path, "llama_gqa_tied")
    weights = path / "model.safetensors"
    state = load_file(weights)
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, weights)
    model = load_model(path, pack_weights=False).model  # packing would add a packed copy of the head
    assert model.lm_head is None
    assert not model.embed_tokens.weight.requires_grad


@pytest.mark.slow
def test_default_model_matches_hf_gguf(
    default_model_dir: Path, hf_default_model: torch.nn.Module, cpu_tier: isa.Tier
) -> None:
    """Our model from the cache vs transformers reading the GGUF itself, on a chat prompt, with
    the kernels of every CPU ISA tier the machine supports; the GGUF dequantized (its quantized
    blocks quantize activations too: tests/unit/test_gguf_quantized.py)."""
    loaded = load_model("default", torch.float32, quantization="none")
    assert loaded.path == default_model_dir
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.tie_word_embeddings and config.eos_token_ids == (2,) and config.rope.theta == 1e5
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    ref = hf_logits(hf_default_model, ids)
    run = PagedRun(loaded.model)
    prefill = run.forward({run.add_request(): ids})[0]
    diff = assert_close(prefill, ref, DEFAULT_TOL)
    run = PagedRun(loaded.model, page_size=4)  # the last 4 tokens as decode steps over the pool
    r = run.add_request()
    steps = [run.forward({r: ids[:-4]})[r], *(run.forward({r: [t]})[r] for t in ids[-4:])]
    decode_diff = assert_close(torch.cat(steps), ref, DEFAULT_TOL)
    print(
        f"default model, tier {cpu_tier}, {len(ids)} tokens: max abs logit diff {diff:.2e} (prefill), "
        f"{decode_diff:.2e} (prefill + decode); logits up to {ref.abs().max():.1f}"
    )


@pytest.mark.slow
def test_default_conversion_is_exact(
    default_model_dir: Path, hf_default_model: torch.nn.Module
) -> None:
    """The cached safetensors (written by models/gguf_weights.py) hold exactly the tensors
    transformers reads from the GGUF, and the cached
    tokenizer encodes like the GGUF's."""
    cached = load_file(default_model_dir / "model.safetensors")
    reference = hf_default_model.state_dict()
    reference.pop("lm_head.weight")  # tied
    assert cached.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(cached[name], tensor), name
    gguf = resolve.default_gguf()
    text = "Hello, world! Ünïcode and code: def f(x): return x**2"
    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert AutoTokenizer.from_pretrained(default_model_dir).encode(text) == hf_tok.encode(text)


@pytest.mark.slow
def test_default_model_warm_load_reads_cache(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(*_: object) -> None:
        raise AssertionError("a warm load must not convert")

    monkeypatch.setattr(resolve, "convert_gguf", no_conversion)
    monkeypatch.setattr(resolve, "dequantize_gguf", no_conversion)
    start = time.perf_counter()
    loaded = load_model("default", torch.float32)
    print(f"warm load of the default model: {time.perf_counter() - start:.2f} s")
    assert loaded.path == default_model_dir
    assert default_model_dir.name == resolve.file_sha256(resolve.default_gguf())
