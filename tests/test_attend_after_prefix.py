"""A large prompt chunk past position 0 attends in two parts merged by their log-sum-exp
(model/llama.py, attend_after_prefix): the same attention as the chunk mask's, to float rounding,
with and without grouped KV heads, and the model's step with it gives the logits and cache of the
masked form."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine_service.model import llama
from engine_service.model.kv_cache import KVCache, PromptChunk, chunk_mask
from engine_service.model.llama import SPLIT_ATTENTION_TOKENS, LlamaForCausalLM, attend_after_prefix
from engine_service.model.presets import PRESETS

CPU = torch.device("cpu")


@pytest.mark.parametrize(("heads", "kv_heads", "dtype", "tolerance"), [
    (4, 4, torch.float32, 2e-6), (6, 2, torch.float32, 2e-6), (9, 3, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("start", "length"), [(1, 1), (40, 7), (100, 300)])
@pytest.mark.parametrize("token_major", [False, True])
def test_the_merged_parts_are_the_masked_attention(heads: int, kv_heads: int, dtype: torch.dtype, tolerance: float,
                                                   start: int, length: int, token_major: bool) -> None:
    g = torch.Generator().manual_seed(start + length + heads)
    # the model's queries are a view of (1, T, H, D) token-major rows; the folded call reshapes them
    q = (torch.randn(1, length, heads, 16, generator=g).transpose(1, 2) if token_major else
         torch.randn(1, heads, length, 16, generator=g)).to(dtype)
    k, v = (torch.randn(1, kv_heads, start + length, 16, generator=g).to(dtype) for _ in range(2))
    mask = chunk_mask(PromptChunk(0, start, length), CPU)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                          enable_gqa=heads != kv_heads)
    got = attend_after_prefix(q, k, v, start)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tolerance)


def test_a_large_chunk_at_depth_gives_the_logits_and_cache_of_the_masked_form(monkeypatch: pytest.MonkeyPatch) -> None:
    m = LlamaForCausalLM(replace(PRESETS["tiny"], num_hidden_layers=2))
    m.init_random(5)
    m.pack_projections()
    context = 300 + SPLIT_ATTENTION_TOKENS
    m.setup_rope(context, CPU)
    g = torch.Generator().manual_seed(3)
    first, second = (torch.randint(3, 250, (n,), generator=g) for n in (300, SPLIT_ATTENTION_TOKENS))
    none = first[:0]
    out = []
    for split in (True, False):
        if not split:  # every chunk masked
            monkeypatch.setattr(llama, "SPLIT_ATTENTION_TOKENS", 10**9)
        cache = KVCache(m.config, 1, context, torch.float32, CPU)
        m.step(none, none, first, [PromptChunk(0, 0, 300)], cache, logits_of=[0])
        logits = m.step(none, none, second, [PromptChunk(0, 300, SPLIT_ATTENTION_TOKENS)], cache)
        out.append((logits, cache))
    (got, got_cache), (want, want_cache) = out
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_cache.k, want_cache.k, rtol=0, atol=1e-5)
    assert not torch.equal(got, want), "two forms of the attention: float rounding apart, not the same call"
