"""A GGUF's tensors read from the file (models/gguf_weights.py): a quantized load writes no
dequantized copy of the weights into the cache, and each tensor read, under our names for a
quantized load or HF's for the weights file a dequantizing load writes, is equal, bit for bit,
to the one transformers' own GGUF loader computes.

Files: the tiny random Llama of bench/gguf_models.py in F16 (no type the kernels serve, so every
tensor is read dequantized: the embedding, the q and k rows llama.cpp permuted, the fused
layers, the norms), and the default model requantized to Q4_K_M (its norms read, most layers
kept as blocks, and the 576-column layers that fall back to Q5_0 read dequantized).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.gguf_models import cached_model
from radixserve.kernels import cpu as cpu_kernels
from radixserve.models import load_model, resolve
from radixserve.models.config import ModelConfig
from radixserve.models.gguf_index import GGUFIndex
from radixserve.models.gguf_quantized import quantize_from_gguf
from radixserve.models.gguf_weights import gguf_names, read_from_gguf
from radixserve.models.llama import LlamaForCausalLM, hf_names

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="the CPU kernels are off here")


def _read_from_file(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """What a quantized load reads from the file, and how many layers it keeps as blocks."""
    config = ModelConfig.from_folder(resolve.resolve_model(path, weights=False))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    index = GGUFIndex(path)
    kept = len(quantize_from_gguf(model, config, index, torch.float32).modules)
    return read_from_gguf(index, model, config, torch.float32), kept


def _assert_equal_to_transformers(path: Path, state: dict[str, torch.Tensor]) -> None:
    """`state` (ours, from a quantized load) and the weights file a dequantizing load writes hold
    exactly the tensors transformers reads from the GGUF."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, torch.cat([oracle[hf] for hf in hf_names(name)])), name
    written = load_model(path, torch.float32, pack_weights=False)  # dequantizing: writes the weights file
    assert written.weight_format == "none"
    checkpoint = load_file(written.path / resolve.WEIGHTS_FILE)
    if written.config.tie_word_embeddings:  # transformers' lm_head is the embedding, not stored
        oracle.pop("lm_head.weight")
    assert checkpoint.keys() == oracle.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(tensor, oracle[name]), name


def test_a_quantized_load_reads_the_file_and_writes_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = cached_model("tiny", "F16")
    monkeypatch.setattr(resolve, "cache_dir", lambda: tmp_path)  # a cold cache for the conversion only
    loaded = load_model(path, torch.float32)  # quantization="gguf": nothing to keep as blocks here
    entry = loaded.path
    assert entry.parent == tmp_path / "models" and loaded.weight_format == "none"
    assert (entry / "config.json").is_file() and (entry / "tokenizer.json").is_file()
    assert not (entry / resolve.WEIGHTS_FILE).exists()
    state, kept = _read_from_file(path)
    assert kept == 0  # every tensor came from the file
    assert {"embed_tokens.weight", "layers.1.self_attn.qkv_proj.weight", "layers.1.mlp.gate_up_proj.weight"} <= set(state)
    _assert_equal_to_transformers(path, state)
    assert (entry / resolve.WEIGHTS_FILE).is_file()  # written once a load needed it
    assert [p.name for p in (tmp_path / "models").iterdir()] == [entry.name]  # no temp folder left


@pytest.mark.slow
def test_the_default_architectures_q4_k_m_reads_its_unserved_layers_from_the_file() -> None:
    path = cached_model("default", "Q4_K_M")
    state, kept = _read_from_file(path)
    assert kept > 0
    assert "norm.weight" in state and "layers.0.input_layernorm.weight" in state
    assert any(name.endswith("qkv_proj.weight") for name in state)  # Q5_0 q and k, permuted in the file
    _assert_equal_to_transformers(path, state)


def test_parameter_names_map_to_the_files_tensors() -> None:
    assert gguf_names("layers.3.self_attn.qkv_proj.weight") == ["blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_v.weight"]
    assert gguf_names("layers.0.self_attn.qkv_proj.bias") == ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"]
    assert gguf_names("layers.12.mlp.gate_up_proj.weight") == ["blk.12.ffn_gate.weight", "blk.12.ffn_up.weight"]
    assert gguf_names("layers.2.post_attention_layernorm.weight") == ["blk.2.ffn_norm.weight"]
    assert gguf_names("layers.2.self_attn.k_norm.weight") == ["blk.2.attn_k_norm.weight"]
    assert gguf_names("lm_head.weight") == ["output.weight"]
    assert gguf_names("norm.weight") == ["output_norm.weight"]
    assert gguf_names("layers.0.mlp.experts.weight") is None
