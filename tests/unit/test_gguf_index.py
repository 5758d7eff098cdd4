"""radixserve/models/gguf_index.py: the tensor index a worker reads from a GGUF file agrees with
the gguf package's own reader, tensor by tensor and field by field, on the default model's file
and on one written with every metadata type, nested arrays, a custom alignment and tensors of
one to three dimensions; and every malformed file (each truncation of a header, a wrong magic or
version, an unknown type, a tensor past the end) is a ValueError that names the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from radixserve.models import default_gguf
from radixserve.models.gguf_index import GGUFIndex


def _assert_agrees_with_gguf_reader(path: Path) -> GGUFIndex:
    index, reader = GGUFIndex(path), GGUFReader(path)
    assert list(index.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = index.tensors[t.name]
        assert ours.dims == tuple(int(d) for d in t.shape)
        assert (ours.type, ours.offset, ours.n_bytes, ours.n_elements) == (int(t.tensor_type), t.data_offset, t.n_bytes, t.n_elements)
        assert ours.type_name == t.tensor_type.name
        rows = index.rows(t.name)
        assert rows.dtype == np.uint8 and rows.tobytes() == np.asarray(t.data).tobytes()
        if rows.dtype == np.asarray(t.data).dtype:  # quantized: gguf's view is [rows..., bytes a row] too
            assert rows.shape == np.asarray(t.data).shape
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        if len(field.types) == 1:
            assert index.metadata[key] == field.contents(), key
        else:  # arrays are stepped over
            assert key not in index.metadata
    return index


def test_the_default_models_file_is_indexed_as_gguf_reads_it() -> None:
    index = _assert_agrees_with_gguf_reader(default_gguf())
    assert index.metadata["general.architecture"] == "llama"
    assert len(index.tensors) == 272


def _write_every_kind(path: Path, alignment: int = 64) -> Path:
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo, ✓")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", -1.5)
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strings", ["a", "", "ccc" * 50])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_string("t.after", "read past every array")
    rng = np.random.default_rng(0)
    writer.add_tensor("vector", rng.standard_normal(10).astype(np.float32))
    writer.add_tensor("matrix", rng.standard_normal((3, 64)).astype(np.float16))
    writer.add_tensor("cube", rng.standard_normal((2, 3, 5)).astype(np.float32))
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("q8", quantize(q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_metadata_type_nested_arrays_alignment_and_dimensions(tmp_path: Path) -> None:
    index = _assert_agrees_with_gguf_reader(_write_every_kind(tmp_path / "kinds.gguf"))
    assert index.metadata["t.str"] == "héllo, ✓" and index.metadata["t.after"] == "read past every array"
    assert index.metadata["t.u64"] == 2**63 + 5 and index.metadata["t.bool"] is True
    assert all(t.offset % 64 == 0 for t in index.tensors.values())
    assert index.tensors["cube"].dims == (5, 3, 2) and index.rows("cube").shape == (2, 3, 20)
    assert index.rows("q8").shape == (4, 68)  # two Q8_0 blocks of 34 bytes a row


def test_every_truncation_of_a_header_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    whole = _write_every_kind(tmp_path / "whole.gguf").read_bytes()
    header_end = min(t.offset for t in GGUFIndex(tmp_path / "whole.gguf").tensors.values())
    cut = tmp_path / "cut.gguf"
    for size in range(header_end):
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=str(cut)):
            GGUFIndex(cut)


def _patched(path: Path, data: bytes, old: bytes, new: bytes) -> Path:
    """`data` with its one occurrence of `old` replaced by `new`, written to `path`."""
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    return path


def test_wrong_magic_version_type_and_sizes_are_value_errors(tmp_path: Path) -> None:
    whole = _write_every_kind(tmp_path / "base.gguf").read_bytes()
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ValueError, match="is not a GGUF file"):
        GGUFIndex(bad)
    bad.write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        GGUFIndex(bad)
    # the q8 tensor's type (8, Q8_0) after its name and dims: made unknown
    entry = b"q8" + (2).to_bytes(4, "little") + (64).to_bytes(8, "little") + (4).to_bytes(8, "little")
    with pytest.raises(ValueError, match="tensor q8 has unknown type 99"):
        GGUFIndex(_patched(tmp_path / "type.gguf", whole, entry + (8).to_bytes(4, "little"), entry + (99).to_bytes(4, "little")))
    # its row length made 65: not whole blocks of 32
    odd = b"q8" + (2).to_bytes(4, "little") + (65).to_bytes(8, "little")
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        GGUFIndex(_patched(tmp_path / "blocks.gguf", whole, entry[: len(odd)], odd))
    # the last tensor's data cut off by a byte
    last = max(GGUFIndex(tmp_path / "base.gguf").tensors.values(), key=lambda t: t.offset)
    bad.write_bytes(whole[: last.offset + last.n_bytes - 1])
    with pytest.raises(ValueError, match="ends past the end of the file"):
        GGUFIndex(bad)
    bad.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="too short to be a GGUF file"):
        GGUFIndex(bad)
