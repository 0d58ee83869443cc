"""The random bfloat16 model the attention kernels' tests run (test_decode_attention.py,
test_prompt_attention.py): heads the kernels take, 64 values and 3 query heads a KV head; and the
mixed step both hold eager and traced to the same bits."""

from __future__ import annotations

import torch

from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.traced_decode import TracedMixed


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


def eager_and_traced_mixed_steps(model: LlamaForCausalLM, cache: KVCache, traced: TracedMixed,
                                 prompts: torch.Tensor, lengths: torch.Tensor, chunk: PromptChunk,
                                 chunk_tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The same mixed step run eagerly then through `traced`, each from the same cache: rows 0..2
    decoding (prefilled from `prompts` to `lengths`, which also gives row 3, the chunk's row, its
    prompt before the chunk), `chunk` of `chunk_tokens` in row 3; each run's (logits, keys, values)."""
    runs = []
    for step in ("eager", "traced"):
        model.prefill(prompts, lengths, cache, 0)
        tokens, positions = torch.tensor([5, 6, 7]), lengths[:3]
        if step == "eager":
            logits = model.step(tokens, positions, chunk_tokens, [chunk], cache, logits_of=[0])
        else:
            logits = traced(tokens, positions, chunk_tokens, chunk, True)
        runs.append((logits, cache.k.clone(), cache.v.clone()))
    return runs
