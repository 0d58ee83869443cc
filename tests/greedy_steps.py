"""Greedy decoding through a given step function, for the tests that set a step (eager, traced,
with or without the engine's kernels) against another on the same prompts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_service.model.kv_cache import KVCache
from engine_service.model.llama import LlamaForCausalLM

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, positions) -> logits (B, V)


def greedy_logits(model: LlamaForCausalLM, cache: KVCache, step: Step, prompts: torch.Tensor,
                  lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill `prompts` (B, T), row b's first lengths[b] tokens, into cache rows 0..B-1, then run
    `steps` decode steps through `step` from tokens 7, 8, ... at each row's length, each next token
    the last step's argmax. Returns the steps' logits, (steps, B, V)."""
    model.prefill(prompts, lengths, cache, 0)
    tokens, positions, logits = torch.arange(prompts.shape[0]) + 7, lengths.clone(), []
    for _ in range(steps):
        out = step(tokens, positions)
        logits.append(out)
        tokens, positions = out.argmax(-1), positions + 1
    return torch.stack(logits)
