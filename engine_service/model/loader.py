"""Build a ready model from `--model`: a preset name (random weights from a fixed seed, or a
packaged real model such as the default `smollm2`), a GGUF file, or a Hugging Face checkpoint
directory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine_service.model.byte_tokenizer import ByteTokenizer
from engine_service.model.chat_template import ChatTemplate, load_chat_template
from engine_service.model.checkpoint import load_checkpoint
from engine_service.model.config import ModelConfig
from engine_service.model.gguf_checkpoint import load_gguf_weights, parse_config, weight_format
from engine_service.model.gguf_reader import read_gguf
from engine_service.model.gguf_tokenizer import build_gguf_tokenizer
from engine_service.model.hf_tokenizer import HFTokenizer, load_tokenizer
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.presets import PACKAGED, PRESET_SEED, PRESETS


class StreamDecoder(Protocol):
    """A tokenizer's incremental decoder: each call's text for the ids since the last one (the bytes
    of an incomplete UTF-8 character held back until it completes)."""

    def step(self, ids: Sequence[int]) -> str: ...


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None = None
    # how the weights are stored: a GGUF's tensor type ("Q4_1"), "safetensors" or "random" (presets)
    weight_format: str = "random"


def load_model(spec: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load a preset by name, a GGUF file (`*.gguf`), or a Hugging Face checkpoint directory by path
    (config.json, *.safetensors, tokenizer.json when present; see checkpoint.py). Raises ValueError
    naming the preset, file, tensor or field that is wrong."""
    if spec in PACKAGED:
        loaded = load_gguf(PACKAGED[spec].locate(spec), device, dtype)
        return LoadedModel(name=spec, config=loaded.config, model=loaded.model, tokenizer=loaded.tokenizer,
                           chat_template=loaded.chat_template, weight_format=loaded.weight_format)
    if spec.endswith(".gguf") or Path(spec).is_file():  # read_gguf names a file that is not a GGUF
        return load_gguf(Path(spec), device, dtype)
    if spec in PRESETS:
        config = PRESETS[spec]
        model = LlamaForCausalLM(config)
        model.init_random(PRESET_SEED)
        model = model.to(device=device, dtype=dtype).eval()
        return LoadedModel(name=spec, config=config, model=model, tokenizer=ByteTokenizer())
    path = Path(spec)
    if not path.is_dir():
        names = ", ".join([*PACKAGED, *PRESETS])
        raise ValueError(f"--model must be a preset ({names}), a .gguf file or a checkpoint directory, got {spec!r}")
    config, model = load_checkpoint(path, device, dtype)
    tokenizer = load_tokenizer(path, config)
    chat_template = load_chat_template(path)
    return LoadedModel(name=config.name, config=config, model=model, tokenizer=tokenizer,
                       chat_template=chat_template, weight_format="safetensors")


def load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A GGUF file: hyper-parameters, tokenizer and chat template from its metadata, weights
    dequantized into `dtype`. Raises CheckpointError naming the file and what is wrong with it."""
    gguf = read_gguf(path)
    config = parse_config(gguf)
    tokenizer = build_gguf_tokenizer(gguf)
    tokens = gguf.require("tokenizer.ggml.tokens", list)
    named = {name: tokens[i] for name, key in GGUF_SPECIAL_TOKENS.items()
             if isinstance(i := gguf.get(key, int), int) and 0 <= i < len(tokens)}
    source = gguf.get("tokenizer.chat_template", str)
    chat_template = None
    if source:
        chat_template = ChatTemplate(source, bos_token=named.pop("bos_token", None),
                                     eos_token=named.pop("eos_token", None), special_tokens=named,
                                     origin=f"tokenizer.chat_template of GGUF file {str(path)!r}")
    model = load_gguf_weights(gguf, config, device, dtype)
    hf_tokenizer = HFTokenizer(tokenizer, config.vocab_size, config.bos_token_id, config.eos_token_id, kind="gguf")
    return LoadedModel(name=config.name, config=config, model=model, tokenizer=hf_tokenizer,
                       chat_template=chat_template, weight_format=weight_format(gguf))


# The special tokens a chat template may name, as transformers passes them for a GGUF tokenizer.
GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id",
}
