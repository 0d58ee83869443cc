"""Model presets with random weights from a fixed seed (for benchmarking the serving stack)."""

from __future__ import annotations

from engine_service.model.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from engine_service.model.config import ModelConfig

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
