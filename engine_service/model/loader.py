"""Build a ready model from `--model`: a preset name (random weights from a fixed seed) or a
Hugging Face checkpoint directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine_service.model.byte_tokenizer import ByteTokenizer
from engine_service.model.checkpoint import load_checkpoint
from engine_service.model.config import ModelConfig
from engine_service.model.hf_tokenizer import load_tokenizer
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.presets import PRESET_SEED, PRESETS


class StreamDecoder(Protocol):
    def step(self, ids: list[int]) -> str: ...


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer


def load_model(spec: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load a preset by name, or a Hugging Face checkpoint directory by path (config.json,
    *.safetensors, tokenizer.json when present; see checkpoint.py). Raises ValueError naming the
    preset, file, tensor or field that is wrong."""
    if spec in PRESETS:
        config = PRESETS[spec]
        model = LlamaForCausalLM(config)
        model.init_random(PRESET_SEED)
        model = model.to(device=device, dtype=dtype).eval()
        return LoadedModel(name=spec, config=config, model=model, tokenizer=ByteTokenizer())
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"--model must be a preset ({', '.join(PRESETS)}) or a checkpoint directory, got {spec!r}")
    config, model = load_checkpoint(path, device, dtype)
    tokenizer = load_tokenizer(path, config)
    return LoadedModel(name=config.name, config=config, model=model, tokenizer=tokenizer)
