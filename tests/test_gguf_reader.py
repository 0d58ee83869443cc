"""Our GGUF reader (engine_service/model/gguf_reader.py) reads what the `gguf` package's reader reads:
the same metadata values (Python types included) and every tensor's data as the same numpy view
(dtype, shape, bytes), on a small file with every value type and on the packaged SmolLM2 file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine_service.model.gguf_reader import read_gguf
from tests.gguf_files import SMOLLM2


def reference_value(field: Any) -> Any:
    """A metadata value as read_gguf gave it when it read files with the `gguf` package."""
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    value = field.contents()
    return value.item() if hasattr(value, "item") else value


def assert_same_as_gguf(path: Path) -> None:
    ours = read_gguf(path)
    reference = GGUFReader(path)
    metadata = {name: reference_value(f) for name, f in reference.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.metadata) == list(metadata)
    for key, expected in metadata.items():
        got = ours.metadata[key]
        assert got == expected and type(got) is type(expected), key
        if isinstance(expected, list):
            assert [type(v) for v in got] == [type(v) for v in expected], key
    assert ours.version == int(reference.fields["GGUF.version"].contents())
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for expected in reference.tensors:
        got = ours.tensors[expected.name]
        assert (got.name, got.tensor_type, got.n_elements, got.n_bytes, got.data_offset) == (
            expected.name, expected.tensor_type, expected.n_elements, expected.n_bytes, expected.data_offset)
        assert got.shape.dtype == expected.shape.dtype and got.shape.tolist() == expected.shape.tolist()
        assert got.data.dtype == expected.data.dtype and got.data.shape == expected.data.shape, expected.name
        assert got.data.tobytes() == expected.data.tobytes(), expected.name


def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -32000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.true", True)
    writer.add_bool("t.false", False)
    writer.add_string("t.str", "héllo ▁wörld 🙂")
    writer.add_array("t.strs", ["a", "", "ĠĠ", "日本", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, 1e-6])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])
    for kind in (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                 GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.INT64, GGUFValueType.FLOAT64):
        writer.add_key_value(f"t.array_{kind.name.lower()}", [0, 1, 7], GGUFValueType.ARRAY, sub_type=kind)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 256)).astype(np.float32)
    writer.add_tensor("f32", weights)
    writer.add_tensor("f32_1d", weights[0, :5].copy())
    writer.add_tensor("f16", weights.astype(np.float16))
    for qtype in (GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                  GGMLQuantizationType.Q4_1):
        writer.add_tensor(qtype.name.lower(), quantize(weights, qtype), raw_dtype=qtype)
    for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):  # gguf quantizes neither: random blocks
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (4, 256 // block_size * type_size), dtype=np.uint8)
        writer.add_tensor(qtype.name.lower(), blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same_as_gguf(path)
    gguf = read_gguf(path)
    assert gguf.metadata["general.alignment"] == 64 and gguf.metadata["t.u64"] == 2**63 + 5
    assert gguf.metadata["t.nested"] == [1, 2, 3]  # flattened, as the gguf package's contents() gives it
    for name, found in gguf.tensors.items():
        assert found.data_offset % 64 == 0, name
        tensor = gguf.tensor(name, torch.float32)
        assert tensor.shape == tuple(reversed(found.shape.tolist()))
        expected = dequantize(found.data, found.tensor_type).reshape(tensor.shape).astype(np.float32)
        assert tensor.numpy().tobytes() == expected.tobytes(), name  # bytes: random blocks may hold NaNs


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="the packaged SmolLM2 file is not installed")
def test_the_packaged_smollm2_file_reads_as_gguf_reads_it() -> None:
    assert_same_as_gguf(SMOLLM2)
