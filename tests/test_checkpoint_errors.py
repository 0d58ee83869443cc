"""Every way a checkpoint directory can be wrong fails at load time with a ValueError whose
message names the file, tensor or field and the value."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_service.model.errors import CheckpointError
from engine_service.model.loader import load_model
from tests.checkpoints import make_checkpoint

CPU = torch.device("cpu")


def _load(directory: Path, dtype: torch.dtype = torch.float32) -> None:
    load_model(str(directory), CPU, dtype)


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_weights(directory: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    if drop is not None:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path, "llama", tied=False)


def expect(directory: Path, *fragments: str, dtype: torch.dtype = torch.float32) -> None:
    with pytest.raises(CheckpointError) as caught:
        _load(directory, dtype)
    assert isinstance(caught.value, ValueError)
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {caught.value}"


def test_missing_directory_names_the_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(str(tmp_path / "nope")))):
        _load(tmp_path / "nope")


def test_missing_config_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()
    expect(checkpoint, str(checkpoint / "config.json"), "missing")


def test_malformed_config_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text("{not json")
    expect(checkpoint, str(checkpoint / "config.json"), "not valid JSON")


def test_unknown_architecture_names_the_field_and_value(checkpoint: Path) -> None:
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    expect(checkpoint, "'architectures'", "GPT2LMHeadModel", "LlamaForCausalLM")


def test_unsupported_rope_scaling_names_the_value(checkpoint: Path) -> None:
    _edit_config(checkpoint, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0})
    expect(checkpoint, "rope scaling type", "'yarn'")


def test_missing_config_field_is_named(checkpoint: Path) -> None:
    raw = json.loads((checkpoint / "config.json").read_text())
    del raw["hidden_size"]
    (checkpoint / "config.json").write_text(json.dumps(raw))
    expect(checkpoint, "'hidden_size'", "required")


def test_invalid_config_value_is_named(checkpoint: Path) -> None:
    _edit_config(checkpoint, num_key_value_heads=3)
    expect(checkpoint, "num_key_value_heads (3)")


def test_shape_mismatch_names_file_tensor_and_shapes(checkpoint: Path) -> None:
    _edit_config(checkpoint, intermediate_size=96)
    expect(checkpoint, "model.safetensors", "model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[96, 64]")


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    _edit_weights(checkpoint, drop="model.layers.1.mlp.up_proj.weight")
    expect(checkpoint, "lacks tensor 'model.layers.1.mlp.up_proj.weight'")


def test_untied_config_without_lm_head_names_it(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "qwen2", tied=True)
    _edit_config(directory, tie_word_embeddings=False)
    expect(directory, "lacks tensor 'lm_head.weight'")


def test_unexpected_tensor_is_named(checkpoint: Path) -> None:
    _edit_weights(checkpoint, add={"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)})
    expect(checkpoint, "model.safetensors", "'model.layers.2.mlp.up_proj.weight'", "does not use")


def test_rotary_inv_freq_of_old_checkpoints_is_ignored(checkpoint: Path) -> None:
    _edit_weights(checkpoint, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    _load(checkpoint)


def test_corrupt_safetensors_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    expect(checkpoint, str(checkpoint / "model.safetensors"), "unreadable")


def test_integer_tensor_is_named(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    expect(checkpoint, "'model.norm.weight'", "torch.int32")


def test_no_safetensors_names_the_directory_and_what_is_there(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    expect(checkpoint, str(checkpoint), "no *.safetensors", "pytorch_model.bin")


def test_index_naming_a_missing_shard_names_it(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "llama", tied=False, sharded=True)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    expect(directory, str(shard), "missing")


def test_unsupported_dtype_is_named(checkpoint: Path) -> None:
    expect(checkpoint, "torch.float64", dtype=torch.float64)


def test_small_vocab_without_tokenizer_json_fails(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "mistral", tied=False, tokenizer=False, vocab_size=200)
    expect(directory, "tokenizer.json", "vocab_size 200", "258")


def test_malformed_tokenizer_json_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").write_text('{"version": "1.0"}')
    expect(checkpoint, str(checkpoint / "tokenizer.json"), "not a valid tokenizer")


def test_tokenizer_larger_than_the_model_vocab_is_named(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "llama", tied=True, vocab_size=280)
    expect(directory, "tokenizer.json", "300 tokens", "vocab_size 280")


def test_bad_eos_token_id_is_named(checkpoint: Path) -> None:
    _edit_config(checkpoint, eos_token_id="</s>")
    expect(checkpoint, "'eos_token_id'", "'</s>'")
