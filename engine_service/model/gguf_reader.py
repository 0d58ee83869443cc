"""A GGUF file, opened and checked before anything is built from it.

The `gguf` package's reader memory-maps the file: metadata is parsed, tensor data stays on disk
until a tensor is dequantized. Everything that can be wrong with the file itself (not a GGUF, a
version we cannot read, a tensor type we do not dequantize, data past the end of the file) is a
CheckpointError naming the file, and the tensor or key, and the value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

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


@dataclass(frozen=True)
class GGUFFile:
    """The metadata (key -> str, int, float, bool or list) and the tensors (name -> memory-mapped
    tensor) of one GGUF file."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, ReaderTensor]

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


def _value(field: Any) -> Any:
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:
        return list(field.contents())
    value = field.contents()
    return value.item() if hasattr(value, "item") else value  # numpy scalars -> int, float, bool


def read_gguf(path: Path) -> GGUFFile:
    """Open and check a GGUF file: its header, every metadata value, and that every tensor is of a
    supported type and lies within the file. Raises CheckpointError."""
    _header(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as err:
        # The reader reads past the end of a truncated file into short arrays, and raises one of
        # these on the bytes it then finds (an unknown value type, a tensor type outside ggml's
        # enum, a duplicate name): all mean the same to a user, the file cannot be read.
        size = path.stat().st_size
        raise CheckpointError(f"GGUF file {str(path)!r} ({size} bytes) is truncated or corrupt: {err}") from err
    size = path.stat().st_size
    tensors: dict[str, ReaderTensor] = {}
    for tensor in reader.tensors:
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
    metadata = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    version = int(reader.fields["GGUF.version"].contents())
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
