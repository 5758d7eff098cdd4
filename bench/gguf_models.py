"""GGUF models written at run time: random Llama-family weights with the default model's
tokenizer, in F16, Q8_0, Q4_0, Q4_1, Q4_K_M (or one type for every tensor), into a cache folder.

    python -m bench.gguf_models --preset 1b --types F16 Q8_0 Q4_0 Q4_K_M    # prints the paths

The repo ships no weights, and the quantized-kernel tests and benchmarks need files of every
format, of the default model's shape and of a ~1B model's. The `gguf` package writes GGUF and
quantizes Q8_0, Q4_0 and Q4_1; it has no quantizer for the K-quants, so this module has one
(`quantize_q4_k`, `quantize_q6_k`: one scale search per sub-block from its range, simpler than
llama.cpp's iterative fit; any valid blocks serve a speed or kernel test, and the quality tests
run on the default model's own Q4_1 file).

Q4_K_M assigns types as llama.cpp's `llama-quantize ... Q4_K_M` does: Q6_K for the output head
(the token embedding, when tied) and for attn_v and ffn_down in the first and last eighth of the
layers and every third between; Q4_K for the rest; and, as it does, Q5_0 for Q4_K and Q8_0 for
Q6_K where a row is not whole 256-value super-blocks (the default model's 576 columns). A llama model's q and k rows are stored in
llama.cpp's rotary order (its converter's permutation), as real files are.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from radixserve.models import default_gguf
from radixserve.models.gguf_index import GGUFIndex
from radixserve.paths import cache_dir

QK_K = 256  # values per K-quant super-block
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M")
_FORMAT_VERSION = 1  # bump when the files written change, so cached ones are rebuilt


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 49152  # the default model's tokenizer
    context_length: int = 8192
    rope_theta: float = 100000.0
    tie_word_embeddings: bool = True


PRESETS = {
    # the default model's architecture (SmolLM2-135M)
    "default": LlamaShape(576, 1536, 30, 9, 3),
    # Llama-3.2-1B's layer shapes with the default tokenizer: 1.07 B parameters
    "1b": LlamaShape(2048, 8192, 16, 32, 8),
    # two layers of head size 64, for fast tests of every format
    "tiny": LlamaShape(256, 512, 2, 4, 2),
}


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, K] float32 (K a multiple of 256) -> Q4_K blocks, uint8 [rows, K / 256 * 144]:
    per 32 values a 6-bit scale and min over the block's fp16 d and dmin, 4-bit quants."""
    rows = x.shape[0]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - lo) / 15.0  # [nb, 8]
    mins = -lo
    d = _fp16(scale.max(axis=-1) / 63.0)
    dmin = _fp16(mins.max(axis=-1) / 63.0)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(mins, dmin32, out=np.zeros_like(mins), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.divide(sub + (dmin32 * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)  # [nb, 8, 32]
    packed_scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
    ], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2p and 2p + 1 share bytes
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, K] float32 (K a multiple of 256) -> Q6_K blocks, uint8 [rows, K / 256 * 210]:
    per 16 values an int8 scale over the block's fp16 d, 6-bit quants stored as 4 + 2 bits."""
    rows = x.shape[0]
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    amax_idx = np.abs(sub).argmax(axis=-1)
    signed_max = np.take_along_axis(sub, amax_idx[..., None], axis=-1)[..., 0]
    scale = -signed_max / 32.0  # the largest value maps to -32, as llama.cpp's fit does
    d = _fp16(np.abs(scale).max(axis=-1) / 127.0)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), -128, 127).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128, chunks of 32
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)


def quantize(x: np.ndarray, type_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """[rows, K] float32 -> (the tensor as GGUF stores it, its type)."""
    qtype = GGMLQuantizationType[type_name]
    if type_name == "Q4_K":
        return quantize_q4_k(x), qtype
    if type_name == "Q6_K":
        return quantize_q6_k(x), qtype
    if type_name in ("F32", "F16"):
        return x.astype(np.float32 if type_name == "F32" else np.float16), qtype
    return gguf_quants.quantize(x.astype(np.float32), qtype), qtype


def _uses_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


# llama-quantize's fallback for a K-quant tensor whose rows are not whole super-blocks
_K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def tensor_type(file_type: str, name: str, num_layers: int, cols: int) -> str:
    """The type a tensor of `cols` columns gets in a file of `file_type` (norms stay F32)."""
    if name.endswith("_norm.weight"):
        return "F32"
    if file_type != "Q4_K_M":
        kind = file_type
    elif name in ("output.weight", "token_embd.weight"):  # the tied embedding serves as the head
        kind = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and _uses_more_bits(int(name.split(".")[1]), num_layers):
        kind = "Q6_K"
    else:
        kind = "Q4_K"
    return _K_QUANT_FALLBACK[kind] if kind in _K_QUANT_FALLBACK and cols % QK_K else kind


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary order -> llama.cpp's (its converter's `permute`), rows of a q or k weight."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary order -> HF's: the inverse of `_permute_rotary`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def default_tensors() -> dict[str, np.ndarray]:
    """The default model's own weights, dequantized from its GGUF: GGUF tensor name -> float32
    (HF's rotary order, as `random_tensors` gives). Requantized into another type, they make a
    file of that type whose greedy output means something, unlike random weights'."""
    shape = PRESETS["default"]
    index = GGUFIndex(default_gguf())
    tensors = {}
    for name, t in index.tensors.items():
        value = gguf_quants.dequantize(index.rows(name), GGMLQuantizationType(t.type)).astype(np.float32)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _unpermute_rotary(value, shape.num_heads if "attn_q" in name else shape.num_kv_heads)
        tensors[name] = value
    return tensors


def random_tensors(shape: LlamaShape, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 [rows, cols] (HF's rotary order), drawn like an init: N(0, 0.02),
    norms near 1. Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    head_dim = shape.hidden_size // shape.num_heads
    h, kv = shape.hidden_size, shape.num_kv_heads * head_dim

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    tensors = {"token_embd.weight": w(shape.vocab_size, h), "output_norm.weight": 1 + w(1, h)[0]}
    if not shape.tie_word_embeddings:
        tensors["output.weight"] = w(shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": 1 + w(1, h)[0], p + "ffn_norm.weight": 1 + w(1, h)[0],
            p + "attn_q.weight": w(h, h), p + "attn_k.weight": w(kv, h), p + "attn_v.weight": w(kv, h),
            p + "attn_output.weight": w(h, h),
            p + "ffn_gate.weight": w(shape.intermediate_size, h), p + "ffn_up.weight": w(shape.intermediate_size, h),
            p + "ffn_down.weight": w(h, shape.intermediate_size),
        }
    return tensors


@functools.cache
def _default_tokenizer_fields() -> list[tuple[str, GGUFValueType, Any]]:
    """The default model's `tokenizer.*` fields as (key, type, value), read once a process:
    gguf's reader parses every string of the vocabulary and merges, which takes seconds."""
    reader = GGUFReader(default_gguf())
    return [(key, field.types[0], field.contents()) for key, field in reader.fields.items()
            if key.startswith("tokenizer.")]


def _copy_tokenizer(writer: GGUFWriter) -> None:
    """The default model's tokenizer and chat template, field by field."""
    for key, kind, value in _default_tokenizer_fields():
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))


def write_gguf(path: Path, shape: LlamaShape, file_type: str, seed: int = 0,
               tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A llama GGUF of `shape` with every weight in `file_type`'s types (see `tensor_type`)."""
    tensors = random_tensors(shape, seed) if tensors is None else tensors
    head_dim = shape.hidden_size // shape.num_heads
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"radixserve random {file_type}")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(shape.vocab_size)
    _copy_tokenizer(writer)
    for name, value in tensors.items():
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = shape.num_heads if "attn_q" in name else shape.num_kv_heads
            value = _permute_rotary(value, heads)
        rows = value if value.ndim == 2 else value[None]
        data, qtype = quantize(rows, tensor_type(file_type, name, shape.num_layers, rows.shape[1]))
        writer.add_tensor(name, data if value.ndim == 2 else data[0], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cached_model(preset: str, file_type: str, seed: int = 0) -> Path:
    """The GGUF of `preset` in `file_type`, written into $RADIXSERVE_CACHE/gguf_models/ once.
    Preset "default" holds the default model's own weights requantized (`default_tensors`);
    the others random ones drawn from `seed`."""
    shape = PRESETS[preset]
    key = hashlib.sha256(json.dumps([_FORMAT_VERSION, asdict(shape), file_type, seed]).encode()).hexdigest()[:12]
    path = cache_dir() / "gguf_models" / f"{preset}-{file_type}-{key}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent builders each write their own
        write_gguf(tmp, shape, file_type, seed, default_tensors() if preset == "default" else None)
        tmp.replace(path)
    return path


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--types", nargs="+", choices=TYPES, default=["F16", "Q8_0", "Q4_0", "Q4_K_M"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = []
    for file_type in args.types:
        paths.append(cached_model(args.preset, file_type, args.seed))
        log(f"{file_type}: {paths[-1]} ({paths[-1].stat().st_size / 2**20:.0f} MiB)")
    return paths


if __name__ == "__main__":
    main()
