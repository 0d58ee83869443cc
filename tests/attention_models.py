"""The random bfloat16 model the attention kernels' tests run (test_decode_attention.py,
test_prompt_attention.py): heads the kernels take, 64 values and 3 query heads a KV head."""

from __future__ import annotations

import torch

from engine_service.model.config import ModelConfig
from engine_service.model.llama import LlamaForCausalLM


def small_bfloat16_model(seed: int, context: int) -> LlamaForCausalLM:
    """A 2-layer random model in bfloat16, projections packed, rotary tables for `context` positions."""
    config = ModelConfig(name="attention-test", vocab_size=300, hidden_size=384, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.init_random(seed)
    model.to(torch.bfloat16).eval()
    model.pack_projections()
    model.setup_rope(context, torch.device("cpu"))
    return model
