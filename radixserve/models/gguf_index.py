"""The tensor index of a GGUF file: every tensor's name, shape, type and bytes (numpy views of
the mapped file) or fp32 values, and the file's scalar and string metadata, read without
parsing the arrays.

A worker that serves a GGUF quantized (`--quantization gguf`, models/gguf_quantized.py) reads
the file's tensor index on every start, and again on every restart after a crash. The gguf
package's `GGUFReader` builds numpy views of every metadata value as it opens a file, the
tokenizer's vocabulary and merges among them (about 100,000 strings in the default model's
file), which takes seconds; the worker needs none of them (its tokenizer comes from the
converted folder, models/resolve.py). This reader steps over each array by its lengths.

Format (GGUF version 2 and 3, little-endian): the magic `GGUF`, a uint32 version, uint64
tensor and metadata counts; then each metadata entry (a string key, a uint32 value type, the
value: a scalar, a string as a uint64 length and its bytes, or an array as a uint32 item type,
a uint64 count and the items); then each tensor's name, uint32 dimension count, uint64
dimensions (ggml order: a row's length first), uint32 type and uint64 offset into the data,
which starts at the next multiple of `general.alignment` (32 unless given).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
HEADER_BYTES = 24  # magic, version, tensor and metadata counts

# metadata value types (gguf.GGUFValueType) that are fixed-size scalars: their struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

Metadata = int | float | bool | str


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the index. `dims` is in ggml order (a row's length first), the reverse of
    numpy's; `offset` is from the start of the file."""

    name: str
    dims: tuple[int, ...]
    type: int  # a GGMLQuantizationType value
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.type).name


class GGUFIndex:
    """A GGUF file's tensors by name (`tensors`), its non-array metadata (`metadata`), and each
    tensor's bytes (`rows`). Raises ValueError, naming the file, for a file it cannot read and
    for anything malformed: a wrong magic or version, a truncated header, a tensor of an
    unknown type or past the end."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{self.path} is too short to be a GGUF file ({size} bytes)")
            self._file = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ValueError(f"cannot read GGUF file {self.path}: {e}") from e
        self._view = memoryview(self._file)
        self._at = 0
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: truncated or malformed GGUF header at byte {self._at}: {e}") from e

    def rows(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as uint8 [numpy shape of its rows..., bytes a row] (a 1-D tensor:
        [bytes]): a view of the mapped file, the layout gguf.quants.dequantize takes."""
        tensor = self.tensors[name]
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type)]
        row_bytes = tensor.dims[0] // block * size
        data = self._file[tensor.offset : tensor.offset + tensor.n_bytes]
        return data.reshape(*reversed(tensor.dims[1:]), row_bytes)

    def values(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to fp32 in numpy's shape, a resident array (the gguf
        package's arithmetic, which transformers' GGUF loader uses too)."""
        values = dequantize(self.rows(name), GGMLQuantizationType(self.tensors[name].type))
        if values.dtype != np.float32 or not values.flags.writeable:  # F32: a view of the mapped file
            values = values.astype(np.float32)
        return values

    def _read_header(self) -> None:
        if bytes(self._view[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (its first bytes are {bytes(self._view[:4])!r})")
        self._at = 4
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (only {VERSIONS})")
        tensor_count, metadata_count = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Metadata] = {}
        for _ in range(metadata_count):
            key = self._string()
            value = self._value(self._scalar("<I"))
            if value is not None:
                self.metadata[key] = value
        entries = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            raise ValueError(f"{self.path}: general.alignment is {alignment!r}, not a positive integer")
        data_start = -(-self._at // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, qtype, offset in entries:
            tensor = self._tensor(name, dims, qtype, data_start + offset)
            if tensor.offset + tensor.n_bytes > len(self._file):
                raise ValueError(f"{self.path}: tensor {name} ends past the end of the file")
            self.tensors[name] = tensor

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = tuple(self._scalar("<Q") for _ in range(n_dims))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: int, offset: int) -> GGUFTensor:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {name} has unknown type {qtype}") from None
        if dims[0] % block:
            raise ValueError(f"{self.path}: tensor {name}'s rows of {dims[0]} are not whole blocks of {block}")
        return GGUFTensor(name, dims, qtype, offset, math.prod(dims) // block * size)

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        if self._at + length > len(self._view):
            raise struct.error(f"a string of {length} bytes runs past the end of the file")
        text = bytes(self._view[self._at : self._at + length]).decode("utf-8")
        self._at += length
        return text

    def _value(self, kind: int) -> Metadata | None:
        """A metadata value of type `kind`; an array is stepped over (None)."""
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            self._skip_array()
            return None
        raise ValueError(f"{self.path}: unknown metadata value type {kind} at byte {self._at - 4}")

    def _skip_array(self) -> None:
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item in _SCALARS:
            self._at += count * struct.calcsize(_SCALARS[item])
            if self._at > len(self._view):
                raise struct.error("an array runs past the end of the file")
        elif item == _STRING:
            lengths = struct.Struct("<Q")
            for _ in range(count):  # each string's length, then its bytes
                self._at += 8 + lengths.unpack_from(self._view, self._at)[0]
        elif item == _ARRAY:
            for _ in range(count):
                self._skip_array()
        else:
            raise ValueError(f"{self.path}: unknown array item type {item} at byte {self._at - 12}")


__all__ = ["GGUFIndex", "GGUFTensor"]
