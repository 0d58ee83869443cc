"""GGUF files for tests, written with the `gguf` package from the tiny Hugging Face checkpoints of
`tests/checkpoints.py`, as llama.cpp's converter writes them (q/k rows permuted for llama-type
models, a gpt2-style tokenizer in the metadata); and the packaged SmolLM2 file.

`write_gguf(directory, path, qtype)` is the builder other tests import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.torch import load_file

from engine_service.model.presets import PACKAGED

os.environ["HF_HUB_OFFLINE"] = "1"

SMOLLM2 = PACKAGED["smollm2"].locate("smollm2")

# Hugging Face names -> llama.cpp's (the converter's direction; the engine maps them back).
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows of each head from halves to interleaved pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(directory: Path, path: Path, qtype: GGMLQuantizationType, *, architecture: str | None = None,
               chat_template: str | None = None, metadata: dict[str, object] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None, drop: str | None = None) -> Path:
    """The checkpoint in `directory` as one GGUF file: 2-D weights in `qtype`, norms and biases F32."""
    config = json.loads((directory / "config.json").read_text())
    arch = architecture or {"Qwen2ForCausalLM": "qwen2"}.get(config["architectures"][0], "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(directory.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _write_tokenizer(writer, directory, config["vocab_size"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))  # type: ignore[arg-type]
    tensors = load_file(directory / "model.safetensors")
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, tensor in tensors.items():
        if drop is not None and gguf_name(name) == drop:
            continue
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, kv_heads)
        if array.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_tokenizer(writer: GGUFWriter, directory: Path, vocab_size: int) -> None:
    """tokenizer.json's byte-level BPE as llama.cpp's `gpt2` tokenizer metadata; the model's padded
    vocabulary beyond the tokenizer's is filled with unused tokens, as the converter does."""
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for token, index in {**vocab, **special}.items():
        tokens[index] = token
        types[index] = TokenType.CONTROL if token in special else TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["<s>"])
    writer.add_eos_token_id(special["</s>"])
    writer.add_pad_token_id(special["<pad>"])
    writer.add_add_bos_token(True)


def hf_gguf_model(path: Path) -> transformers.PreTrainedModel:
    """The reference: transformers' own loading of the GGUF file (float32, eager attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()


def hf_gguf_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
