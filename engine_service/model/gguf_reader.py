"""A GGUF file, opened and checked before anything is built from it.

The file is memory-mapped and read here (header, metadata, tensor infos: `struct` over the map, a
tight loop for the tokenizer's string arrays, far faster than the `gguf` package's reader, which
builds a numpy slice per string); tensor data stays on disk until a tensor is dequantized (with the
`gguf` package, from a numpy view laid out as its reader lays it out). Everything that can be wrong with the file itself (not a GGUF, a
version we cannot read, a tensor type we do not dequantize, data past the end of the file) is a
CheckpointError naming the file, and the tensor or key, and the value.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine_service.model.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# The tensor types we dequantize (with the `gguf` package), by name as llama.cpp spells them.
TENSOR_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})
TENSOR_TYPE_NAMES = ", ".join(sorted(t.name for t in TENSOR_TYPES))


class GGUFTensor(NamedTuple):
    """One tensor, as `gguf.ReaderTensor` has it: `shape` in GGUF order (innermost dimension first,
    the reverse of torch's), `data` a read-only numpy view of the mapped file (F32/F16/F64/I*: the
    elements in numpy order; every other type: uint8 bytes, rows of blocks), `data_offset` and
    `n_bytes` where that data lies in the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """The metadata (key -> str, int, float, bool or list) and the tensors (name -> memory-mapped
    tensor) of one GGUF file."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """The value of metadata `key`, checked to be of `kind`; `default` when the key is absent."""
        if key not in self.metadata:
            return default
        value = self.metadata[key]
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise CheckpointError(f"GGUF file {str(self.path)!r}: metadata {key!r} must be a number, got {value!r}")
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise CheckpointError(f"GGUF file {str(self.path)!r}: metadata {key!r} must be {names}, got {value!r}")
        return value

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        value = self.get(key, kind)
        if value is None:
            raise CheckpointError(f"GGUF file {str(self.path)!r} lacks metadata {key!r}")
        return value

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` dequantized to float32 from the mapped file, then cast to `dtype`
        (numpy shape order: rows first, as torch's Linear weights are)."""
        found = self.tensors[name]
        array = dequantize(found.data, found.tensor_type)  # F32: a read-only view of the mapped file
        if not array.flags.writeable:
            array = array.copy()  # the one copy, into memory torch may own
        shape = tuple(int(d) for d in reversed(found.shape.tolist()))
        return torch.from_numpy(array.reshape(shape)).to(dtype=dtype)


def _header(path: Path) -> None:
    """Magic and version, read directly, so that the two most common mistakes get their own words."""
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except FileNotFoundError:
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist") from None
    except OSError as err:
        raise CheckpointError(f"GGUF file {str(path)!r} is unreadable: {err}") from err
    if head[:4] != MAGIC:
        raise CheckpointError(f"file {str(path)!r} is not a GGUF file: it starts with {head[:4]!r}, not {MAGIC!r}")
    if len(head) < 8:
        raise CheckpointError(f"GGUF file {str(path)!r} is truncated: {len(head)} bytes")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in VERSIONS:
        raise CheckpointError(
            f"GGUF file {str(path)!r} has version {version}; versions {' and '.join(map(str, VERSIONS))} are supported"
        )


class _Corrupt(ValueError):
    """What the parser finds wrong with the bytes; read_gguf makes it a CheckpointError."""


# Scalar value types: struct format and size (little-endian, as GGUF is).
_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2), GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8), GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
# The same types as numpy dtypes, for arrays of them (read at once, `tolist` gives Python values).
_ARRAY_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.BOOL: np.dtype(np.bool_),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Tensor types whose data `gguf` lays out as elements (all others: bytes, see GGUFTensor).
_ELEMENT_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F16: np.dtype("<f2"), GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"), GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Parser:
    """Reads values at `offset` in the mapped file, refusing to read past its end."""

    def __init__(self, view: mmap.mmap) -> None:
        self.view = view
        self.size = len(view)
        self.offset = 0

    def need(self, n: int, what: str) -> None:
        if self.offset + n > self.size:
            raise _Corrupt(f"{what} at offset {self.offset} needs {n} bytes, past the end of the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.view, self.offset)
        self.offset += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.view, self.offset)
        self.offset += 8
        return value

    def string(self, what: str) -> str:
        length = self.u64(what)
        self.need(length, what)
        start = self.offset
        self.offset += length
        return str(self.view[start:self.offset], "utf-8")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: the tokenizer's vocabulary and merges, the bulk of the metadata."""
        view, size, offset = self.view, self.size, self.offset
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if offset + 8 > size:
                raise _Corrupt(f"{what} at offset {offset} runs past the end of the file")
            (length,) = unpack(view, offset)
            offset += 8
            end = offset + length
            if end > size:
                raise _Corrupt(f"{what} at offset {offset} needs {length} bytes, past the end of the file")
            append(str(view[offset:end], "utf-8"))
            offset = end
        self.offset = offset
        return out

    def value(self, raw_type: int, what: str) -> tuple[GGUFValueType, Any]:
        """A value of `raw_type`: (its type, the Python value; an array's items flattened, as the
        `gguf` package's `contents()` gives them)."""
        kind = GGUFValueType(raw_type)  # ValueError: an unknown type
        if kind == GGUFValueType.STRING:
            return kind, self.string(what)
        scalar = _SCALARS.get(kind)
        if scalar is not None:
            fmt, n = scalar
            self.need(n, what)
            (value,) = struct.unpack_from(fmt, self.view, self.offset)
            self.offset += n
            return kind, value
        if kind == GGUFValueType.ARRAY:
            item_type = self.u32(what)
            count = self.u64(what)
            if count and item_type == GGUFValueType.STRING:
                return kind, self.strings(count, what)
            dtype = _ARRAY_DTYPES.get(item_type)
            if count and dtype is not None:
                self.need(count * dtype.itemsize, what)
                items = np.frombuffer(self.view, dtype, count, self.offset).tolist()
                self.offset += count * dtype.itemsize
                return kind, items
            items = []
            for _ in range(count):  # arrays of arrays (flattened), or an unknown item type (refused)
                _, item = self.value(item_type, what)
                if isinstance(item, list):
                    items.extend(item)
                else:
                    items.append(item)
            return kind, items
        raise _Corrupt(f"{what} has unhandled value type {kind.name}")


def _parse(path: Path) -> tuple[int, dict[str, Any], list[GGUFTensor]]:
    """Version, metadata and tensors (each a view of the map) of the file. Raises _Corrupt,
    ValueError (an unknown value or tensor type), KeyError (a duplicate key)."""
    with path.open("rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the handle
    parser = _Parser(view)
    parser.offset = 4
    version = parser.u32("the version")
    tensor_count = parser.u64("the tensor count")
    kv_count = parser.u64("the metadata count")
    metadata: dict[str, Any] = {}
    types: dict[str, GGUFValueType] = {}
    for _ in range(kv_count):
        at = parser.offset
        key = parser.string(f"a metadata key at offset {at}")
        if key in metadata or key in ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            raise KeyError(f"Duplicate {key} already in list at offset {at}")
        types[key], metadata[key] = parser.value(parser.u32(f"metadata {key!r}"), f"metadata {key!r}")
    infos = []
    for _ in range(tensor_count):
        name = parser.string(f"a tensor name at offset {parser.offset}")
        n_dims = parser.u32(f"tensor {name!r}")
        parser.need(8 * n_dims, f"tensor {name!r}")
        dims = np.frombuffer(view, np.dtype("<u8"), n_dims, parser.offset).astype(np.uint64)
        parser.offset += 8 * n_dims
        raw_type = parser.u32(f"tensor {name!r}")
        infos.append((name, dims, raw_type, parser.u64(f"tensor {name!r}")))
    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        if types["general.alignment"] != GGUFValueType.UINT32:
            raise ValueError("Bad type for general.alignment field")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
    start = parser.offset + (-parser.offset % alignment)
    tensors: list[GGUFTensor] = []
    names: set[str] = set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"Found duplicated tensor with name {name}")
        names.add(name)
        ggml_type = GGMLQuantizationType(raw_type)  # ValueError: a type outside ggml's enum
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        data_offset = int(start + offset)
        np_dims = tuple(reversed(dims.tolist()))
        dtype = _ELEMENT_DTYPES.get(ggml_type)
        if dtype is None:
            dtype, count = np.dtype(np.uint8), n_bytes
            np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
        else:
            count = n_elements
        if count == 0:
            data = np.zeros(np_dims, dtype)
        elif data_offset + count * dtype.itemsize <= parser.size:
            data = np.frombuffer(view, dtype, count, data_offset).reshape(np_dims)
        else:  # past the end: read_gguf says so, naming the tensor
            data = np.zeros(0, np.uint8)
        tensors.append(GGUFTensor(name, ggml_type, dims, n_elements, n_bytes, data_offset, data))
    return version, metadata, tensors


def read_gguf(path: Path) -> GGUFFile:
    """Open and check a GGUF file: its header, every metadata value, and that every tensor is of a
    supported type and lies within the file. Raises CheckpointError."""
    _header(path)
    try:
        version, metadata, parsed = _parse(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as err:
        # A truncated file runs out of bytes; a corrupt one has bytes that make no sense (an unknown
        # value type, a tensor type outside ggml's enum, a duplicate name): all mean the same to a
        # user, the file cannot be read.
        size = path.stat().st_size
        raise CheckpointError(f"GGUF file {str(path)!r} ({size} bytes) is truncated or corrupt: {err}") from err
    size = path.stat().st_size
    tensors: dict[str, GGUFTensor] = {}
    for tensor in parsed:
        if tensor.tensor_type not in TENSOR_TYPES:
            raise CheckpointError(
                f"GGUF file {str(path)!r}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not "
                f"supported (supported: {TENSOR_TYPE_NAMES})"
            )
        end = tensor.data_offset + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != tensor.n_bytes:
            raise CheckpointError(
                f"GGUF file {str(path)!r} is truncated: tensor {tensor.name!r} needs bytes up to {end}, "
                f"the file has {size}"
            )
        tensors[tensor.name] = tensor
    metadata = {name: value for name, value in metadata.items() if not name.startswith("GGUF.")}
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
