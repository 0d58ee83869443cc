"""Loading Hugging Face checkpoint directories: config mapping, weights, tied embeddings, shards,
dtypes, devices and tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
import torch
from safetensors.torch import load_file

from engine_service.model.loader import load_model
from tests.checkpoints import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    LLAMA3_ROPE,
    PROMPTS,
    build_tokenizer,
    engine_greedy,
    make_checkpoint,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_loads_every_tensor_of_each_architecture(tmp_path: Path, arch: str, tied: bool) -> None:
    directory = make_checkpoint(tmp_path, arch, tied)
    loaded = load_model(str(directory), CPU, torch.float32)
    assert loaded.name == directory.name
    assert loaded.config.tie_word_embeddings is tied
    assert loaded.config.attention_bias is (arch == "qwen2")
    saved = load_file(directory / "model.safetensors")
    ours = loaded.model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor), name
    params = dict(loaded.model.named_parameters(remove_duplicate=False))
    assert all(p.device == CPU for p in params.values()), "a parameter stayed on the meta device"
    tied_now = params["lm_head.weight"] is params["model.embed_tokens.weight"]
    assert tied_now is tied


def test_sharded_checkpoint_loads_through_its_index(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "llama", tied=False, sharded=True)
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("*.safetensors"))) > 2
    whole = load_model(str(make_checkpoint(tmp_path, "llama", tied=False)), CPU, torch.float32)
    sharded = load_model(str(directory), CPU, torch.float32)
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(sharded.model.state_dict()[name], tensor), name


def test_config_fields_map_onto_model_config(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "llama", tied=False, rope_scaling=LLAMA3_ROPE)
    config = load_model(str(directory), CPU, torch.float32).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling_dict == LLAMA3_ROPE
    assert (config.bos_token_id, config.eos_token_id, config.end_token_ids) == (BOS_ID, EOS_ID, (EOS_ID,))
    assert config.dim_per_head == 16 and config.num_key_value_heads == 2


def test_transformers_4_layout_and_eos_list(tmp_path: Path) -> None:
    """Real checkpoints written by transformers 4.x keep rope_theta/rope_scaling at the top level,
    and Llama 3 lists several eos ids: the first is eos_token_id, all are stop ids."""
    directory = make_checkpoint(tmp_path, "llama", tied=True)
    raw = json.loads((directory / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[2, 5])
    (directory / "config.json").write_text(json.dumps(raw))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = load_model(str(directory), CPU, torch.float32).config
    assert config.rope_theta == 20000.0
    assert config.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_id == 2 and config.end_token_ids == (2, 5, 7)


def test_mistral_sliding_window_bounds_the_served_context(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "mistral", tied=False)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "sliding_window": 64}))
    loaded = load_model(str(directory), CPU, torch.float32)
    loaded.model.setup_rope(64, CPU)
    with pytest.raises(ValueError, match="max context 65 exceeds the model's sliding_window 64"):
        loaded.model.setup_rope(65, CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_load_and_run(tmp_path: Path, dtype: torch.dtype) -> None:
    loaded = load_model(str(make_checkpoint(tmp_path, "qwen2", tied=True)), CPU, dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {dtype}
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:2]]
    out = engine_greedy(loaded.model, prompts, 4, CPU)
    assert all(len(row) == 4 for row in out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_loads_onto_the_device_and_agrees_with_cpu(tmp_path: Path, dtype: torch.dtype) -> None:
    directory = make_checkpoint(tmp_path, "llama", tied=False, sharded=True)
    cuda = load_model(str(directory), torch.device("cuda"), dtype)
    assert {p.device.type for p in cuda.model.parameters()} == {"cuda"}
    cpu = load_model(str(directory), CPU, torch.float32)
    prompts = [cpu.tokenizer.encode(p) for p in PROMPTS]
    first_gpu = [row[0] for row in engine_greedy(cuda.model, prompts, 1, torch.device("cuda"))]
    first_cpu = [row[0] for row in engine_greedy(cpu.model, prompts, 1, CPU)]
    assert sum(a == b for a, b in zip(first_gpu, first_cpu, strict=True)) >= len(prompts) - 1


def test_tokenizer_json_encodes_with_bos_and_streams(tmp_path: Path) -> None:
    loaded = load_model(str(make_checkpoint(tmp_path, "llama", tied=False)), CPU, torch.float32)
    tokenizer = loaded.tokenizer
    assert tokenizer.kind == "tokenizer.json"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (BOS_ID, EOS_ID, 320)
    text = "naïve café 東京 🙂 and the lazy dog"
    ids = tokenizer.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == build_tokenizer().encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    for chunk in (1, 3):
        stream = tokenizer.stream_decoder()
        pieces = [stream.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        assert "".join(pieces) == text
        assert all("\ufffd" not in piece for piece in pieces)


def test_tokenizer_config_supplies_missing_special_ids(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "qwen2", tied=False)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "bos_token_id": None, "eos_token_id": None}))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    (directory / "generation_config.json").unlink()
    tokenizer = load_model(str(directory), CPU, torch.float32).tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)


def test_without_tokenizer_json_falls_back_to_bytes_and_logs_it(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "mistral", tied=True, tokenizer=False)
    with structlog.testing.capture_logs() as events:
        loaded = load_model(str(directory), CPU, torch.float32)
    assert loaded.tokenizer.kind == "byte"
    fallback = [e for e in events if e["event"] == "tokenizer_fallback"]
    assert fallback and fallback[0]["log_level"] == "warning" and fallback[0]["directory"] == str(directory)


def test_building_a_model_to_load_leaves_the_embedding_uninitialised(monkeypatch: pytest.MonkeyPatch) -> None:
    # the checkpoint readers build the model on the meta device; nn.Embedding's own init there went
    # through torch._refs and imported torch._dynamo: 1.5-2 s of every engine's start (Xeon 207)
    from engine_service.model.llama import LlamaForCausalLM
    from engine_service.model.presets import PRESETS

    def refuse(self: torch.nn.Embedding) -> None:
        raise AssertionError("nn.Embedding.reset_parameters ran: every loader assigns the table")

    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", refuse)
    with torch.device("meta"):
        model = LlamaForCausalLM(PRESETS["tiny"])
    assert model.model.embed_tokens.weight.shape == (PRESETS["tiny"].vocab_size, PRESETS["tiny"].hidden_size)
    assert model.model.embed_tokens.weight.device.type == "meta"
