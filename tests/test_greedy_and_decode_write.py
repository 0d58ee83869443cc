"""Two fast paths of the decode step held to what they replace: `sampler.greedy` to torch's argmax
(the first of equal maxima, NaNs, a vocabulary that is not a multiple of its block), and
`KVCache.write_decode` at `decode_slots` to the index_put_ on (rows, positions) it replaced."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_service.generation.sampler import ARGMAX_BLOCK, greedy
from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import KVCache


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 6), extra=st.sampled_from([0, 0, 1, 17]),
       seed=st.integers(0, 2**31 - 1), levels=st.integers(1, 4), nans=st.integers(0, 2))
def test_greedy_is_argmax_ties_and_nans_included(rows: int, blocks: int, extra: int, seed: int, levels: int,
                                                 nans: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab = blocks * ARGMAX_BLOCK + extra
    # few distinct values, so that most rows hold their max several times, across blocks too
    logits = torch.randint(0, levels, (rows, vocab), generator=generator).float()
    for _ in range(nans):
        logits[torch.randint(0, rows, (1,), generator=generator), torch.randint(0, vocab, (1,), generator=generator)] \
            = float("nan")
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_greedy_takes_the_first_maximum_in_a_later_block() -> None:
    logits = torch.zeros(2, 4 * ARGMAX_BLOCK)
    logits[0, [3 * ARGMAX_BLOCK + 5, 3 * ARGMAX_BLOCK + 9]] = 2.0
    logits[1, [ARGMAX_BLOCK - 1, ARGMAX_BLOCK]] = 1.0  # equal maxima either side of a block's edge
    assert greedy(logits).tolist() == [3 * ARGMAX_BLOCK + 5, ARGMAX_BLOCK - 1]


def test_write_decode_puts_each_row_at_its_position_in_every_head() -> None:
    config = ModelConfig(name="write-test", vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    cache = KVCache(config, max_batch=4, max_context=10, dtype=torch.float32, device=torch.device("cpu"))
    expected_k, expected_v = cache.k.clone(), cache.v.clone()
    rows, positions = torch.arange(3), torch.tensor([7, 0, 9])
    k = torch.randn(2, 3, config.dim_per_head)  # (KV, d, D)
    v = torch.randn(2, 3, config.dim_per_head)
    cache.write_decode(1, cache.decode_slots(rows, positions), k, v)
    expected_k[1][rows, :, positions] = k.transpose(0, 1)
    expected_v[1][rows, :, positions] = v.transpose(0, 1)
    assert torch.equal(cache.k, expected_k) and torch.equal(cache.v, expected_v)
    assert cache.k[1, 2, 1, 9].equal(k[1, 2]) and not cache.k[0].any() and not cache.k[1, 3].any()


def test_greedy_reads_strided_logits() -> None:
    logits = torch.randn(3, 2 * 4 * ARGMAX_BLOCK, generator=torch.Generator().manual_seed(5))[:, ::2]
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
