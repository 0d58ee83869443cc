"""The prefix cache and chunked prefill change no result: the real tiny model in float32 driven step
by step by the DecodeLoop through mixed traffic (shared prefixes that end mid-block, a prompt that
is a strict prefix of a cached one, an exact repeat, a next turn that extends a finished
conversation, distinct prompts that force eviction), arriving while others decode. Every
configuration (cache off, on, on and tiny; one-piece and chunked prefill) must produce the same
greedy tokens, and the cache must really have been hit (and evicted from) for that to mean
anything. Then the store on its own. In-process only (make mutate runs these); the wire, Usage,
GetLoad, Prometheus and the span, is tests/test_prefix_cache_served.py."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.faults import FaultInjector, FaultPlan
from engine_service.model.kv_cache import KVCache
from engine_service.model.loader import load_model
from engine_service.requests import Request, SamplingParams
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import DecodeLoop
from engine_service.runtime.model_runner import ModelRunner
from engine_service.scheduling.prefix_cache import BLOCK_TOKENS, PrefixCache, _runs
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import Sequence

CPU = torch.device("cpu")
MAX_BATCH = 3
MAX_CONTEXT = 192


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    loaded = load_model("tiny", CPU, torch.float32)
    return ModelRunner(loaded.model, MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)


def ids(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, 250, (n,), generator=g).tolist())


BASE = ids(1, 70)  # 4 full blocks and 6 tokens


def traffic(first_answer: tuple[int, ...]) -> list[tuple[int, str, tuple[int, ...], int]]:
    """(step to submit at, id, prompt, max_new_tokens); `first_answer` is what "first" generates."""
    return [
        (0, "first", BASE + ids(2, 10), 30),  # finishes with 109 tokens in the cache: 6 full blocks
        (0, "other", ids(3, 40), 30),
        (3, "mid-block", BASE + ids(4, 9), 8),  # shares 70 tokens: 4 blocks hit, the 5th is mid-block
        (3, "strict-prefix", BASE[:40], 8),  # a prefix of a cached prompt: 2 blocks hit
        (4, "repeat", BASE + ids(2, 10), 12),  # the same prompt: every block but the one with the last token
        (20, "next-turn", BASE + ids(2, 10) + first_answer + ids(5, 7), 6),  # hits its generated blocks too
        (40, "distinct-1", ids(6, 50), 5),  # after next-turn ends: 4 x 3 new blocks push the base chain out
        (40, "distinct-2", ids(7, 50), 5),
        (41, "distinct-3", ids(8, 50), 5),
        (42, "distinct-4", ids(10, 50), 5),
        (60, "base-again", BASE + ids(9, 3), 6),  # hit unless the tiny store evicted the base chain
    ]


def run(runner: ModelRunner, prefix: PrefixCache, budget: int, plan) -> tuple[dict[str, tuple[int, ...]],  # type: ignore[no-untyped-def]
                                                                            dict[str, int]]:
    """Step the loop through `plan`; tokens and cached prompt tokens by request id."""
    scheduler = Scheduler(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, queue_capacity=16, queue_retry_seconds=0.5,
                          prefill_token_budget=budget)
    delivered: list[Delta] = []

    def fatal(exc: BaseException) -> None:
        raise AssertionError(f"on_fatal: {exc!r}")

    loop = DecodeLoop(runner, scheduler, FaultInjector(FaultPlan()), frozenset(), delivered.extend, fatal, prefix)
    seqs: list[Sequence] = []
    pending = sorted(plan, key=lambda p: p[0])
    step = 0
    while pending or scheduler.rows or scheduler.waiting_count():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, max_new = pending.pop(0)
            request = Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new,
                              sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None)
            seqs.append(Sequence(request, sink=None))
            scheduler.submit(seqs[-1])
        loop.step()
        step += 1
    assert all(e.error is None for e in delivered)
    assert all(len(s.generated) == s.request.max_new_tokens for s in seqs)
    return {s.request_id: tuple(s.generated) for s in seqs}, {s.request_id: s.cached_tokens for s in seqs}


def test_greedy_tokens_are_the_same_with_the_cache_on_off_and_evicting_and_with_chunked_prefill(runner):
    first, _ = run(runner, PrefixCache(0), 4096, traffic(())[:1])
    plan = traffic(first["first"])
    want, cached = run(runner, PrefixCache(0), 4096, plan)  # one-piece prefill, no cache
    assert set(cached.values()) == {0}
    chunked, _ = run(runner, PrefixCache(0), 24, plan)
    assert chunked == want, "chunked prefill changed a result"

    big = PrefixCache(1024)
    got, cached = run(runner, big, 24, plan)
    assert got == want, "the prefix cache changed a result"
    assert cached["first"] == 0 and cached["other"] == 0
    assert cached["mid-block"] == 64 and cached["strict-prefix"] == 32 and cached["repeat"] == 64
    assert cached["next-turn"] == 96, "a next turn hits the finished conversation's generated blocks"
    assert cached["base-again"] == 64
    stats = big.stats()
    assert stats.hit_tokens == sum(cached.values()) and stats.queried_tokens == sum(len(p[2]) for p in plan)

    tiny = PrefixCache(6 * BLOCK_TOKENS)  # 96 tokens: the distinct prompts push the base chain out
    got, cached = run(runner, tiny, 24, plan)
    assert got == want, "eviction changed a result"
    assert cached["repeat"] == 64, "the base chain was cached before the pressure"
    assert cached["base-again"] < 64, "the tiny store evicted nothing"
    assert tiny.stats().used_tokens <= 6 * BLOCK_TOKENS


# -- the store on its own ----------------------------------------------------------------------

@pytest.fixture
def cache(runner: ModelRunner) -> KVCache:
    kv = KVCache(runner.model.config, 2, 128, torch.float32, CPU)
    kv.k.normal_()
    kv.v.normal_()
    return kv


def test_reused_blocks_are_the_stored_rows_bit_for_bit_and_never_the_last_prompt_token(cache):
    store = PrefixCache(256)
    prompt = ids(11, 48)  # exactly 3 blocks
    store.offer(prompt, cache, 0, 48)
    assert store.stats().used_tokens == 48
    assert store.reuse(prompt, cache, 1) == 32  # the third block holds the last token: computed, not reused
    assert torch.equal(cache.k[:, 1, :, :32], cache.k[:, 0, :, :32])
    assert torch.equal(cache.v[:, 1, :, :32], cache.v[:, 0, :, :32])
    assert store.reuse(prompt + (7,), cache, 1) == 48
    assert store.reuse((99,) + prompt, cache, 1) == 0  # same tokens at other positions are other blocks
    assert store.reuse(prompt[:16] + (0,) * 32, cache, 1) == 16
    assert store.stats().queried_tokens == 48 + 49 + 49 + 48 and store.stats().hit_tokens == 32 + 48 + 16


def test_partial_blocks_are_not_stored_and_a_full_store_evicts_the_least_recent_leaf_first(cache):
    store = PrefixCache(4 * BLOCK_TOKENS)
    a, b = ids(12, 40), ids(13, 32)
    store.offer(a, cache, 0, 40)  # 2 full blocks; the 8 tokens after them are not stored
    store.offer(b, cache, 1, 32)  # 2 more: full
    assert store.stats().used_tokens == 64
    assert store.reuse(a + (1,), cache, 1) == 32  # a is now more recent than b
    store.offer(ids(14, 16), cache, 0, 16)  # evicts b's leaf (b's 2nd block), not b's root, not a's
    assert store.reuse(b + (1,), cache, 1) == 16
    assert store.reuse(a + (1,), cache, 1) == 32


def test_a_chain_longer_than_the_store_keeps_its_head_and_never_evicts_itself(cache):
    store = PrefixCache(2 * BLOCK_TOKENS)
    prompt = ids(15, 80)
    store.offer(prompt, cache, 0, 80)
    assert store.stats().used_tokens == 32
    assert store.reuse(prompt, cache, 1) == 32  # its first two blocks, not a broken chain


def test_a_chain_in_scattered_slots_is_copied_back_to_its_positions(cache):
    store = PrefixCache(6 * BLOCK_TOKENS)
    store.offer(ids(16, 32), cache, 0, 32)  # slots 0, 1
    store.offer(ids(17, 48), cache, 0, 48)  # slots 2, 3, 4
    store.reuse(ids(16, 32) + (1,), cache, 1)  # the first chain is the more recent: the second's leaves go first
    cache.k[:, 0].normal_()
    cache.v[:, 0].normal_()
    prompt = ids(18, 64)
    store.offer(prompt, cache, 0, 64)  # slot 5, then 4, 3, 2 evicted and taken in that order
    assert [b.slot for b in store._walk(prompt, 4)] == [5, 4, 3, 2]
    assert store.reuse(prompt + (1,), cache, 1) == 64
    assert torch.equal(cache.k[:, 1, :, :64], cache.k[:, 0, :, :64])
    assert torch.equal(cache.v[:, 1, :, :64], cache.v[:, 0, :, :64])


def test_a_block_matches_only_at_its_own_depth_under_its_own_parent(cache):
    store = PrefixCache(8 * BLOCK_TOKENS)
    a, b, x = ids(19, 16), ids(20, 16), ids(21, 16)
    store.offer(a + b + x, cache, 0, 48)  # three blocks: x's keys are for positions 32..47, after a and b
    assert store.reuse(x + (1,), cache, 1) == 0, "x's tokens first are not x's block"
    assert store.reuse(b + x + (1,), cache, 1) == 0
    store.offer(b + x, cache, 0, 32)  # b and x at 0..31: blocks of their own, beside a's chain
    assert store.stats().used_tokens == 5 * BLOCK_TOKENS
    assert store.reuse(a + b + x + (1,), cache, 1) == 48 and store.reuse(b + x + (1,), cache, 1) == 32


def test_a_parent_is_evicted_only_after_every_block_that_extends_it(cache):
    store = PrefixCache(3 * BLOCK_TOKENS)
    a, b, c, d, e, f = (ids(30 + i, 16) for i in range(6))
    store.offer(a + b, cache, 0, 32)
    store.offer(a + c, cache, 0, 32)  # a has two children; the store is full: b, c, a, oldest first
    store.offer(d, cache, 0, 16)  # evicts b, the oldest leaf: c, a, d
    store.offer(e, cache, 0, 16)  # evicts c, a's last child: a, d, e
    store.offer(f, cache, 0, 16)  # a, the oldest now and a leaf, goes, not d
    assert store.reuse(a + c + (1,), cache, 1) == 0 and store.reuse(a + (1,), cache, 1) == 0
    assert [store.reuse(block + (1,), cache, 1) for block in (d, e, f)] == [16, 16, 16]


def test_the_store_takes_the_caches_dtype(runner: ModelRunner):
    kv = KVCache(runner.model.config, 2, 64, torch.bfloat16, CPU)
    kv.k.normal_()
    kv.v.normal_()
    store = PrefixCache(2 * BLOCK_TOKENS)
    store.offer(ids(22, 32), kv, 0, 32)
    # the bytes engine_ready gives as prefix_cache_bytes: the cache's per token, not float32's
    assert store._k is not None and store._v is not None
    assert (store._k.dtype, store._v.dtype) == (torch.bfloat16, torch.bfloat16)
    assert store.reuse(ids(22, 32) + (1,), kv, 1) == 32 and torch.equal(kv.k[:, 1, :, :32], kv.k[:, 0, :, :32])


def _resident(t: torch.Tensor) -> float:
    """The fraction of `t`'s pages in memory (mincore(2))."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / len(vec)


def test_reserve_writes_the_whole_store_once_so_its_pages_are_resident_before_any_step(runner: ModelRunner):
    kv = KVCache(runner.model.config, 2, 64, torch.bfloat16, CPU)
    kv.k.normal_()
    kv.v.normal_()
    # the tiny model: 32,768 slots of 2 KiB each for keys and values, 64 MiB each: above what
    # malloc serves from its heap, so mapped afresh, no page in memory until written
    store = PrefixCache(32768 * BLOCK_TOKENS)
    store.reserve(kv)
    assert store._k is not None and store._v is not None
    assert store._k.shape == (32768, kv.k.shape[0], kv.k.shape[2], BLOCK_TOKENS, kv.k.shape[4])
    assert store._k.numel() * store._k.element_size() == 64 * 2**20
    assert _resident(store._k) > 0.99 and _resident(store._v) > 0.99, "written, not only allocated"
    assert _resident(torch.empty(32 * 2**20, dtype=torch.bfloat16)) < 0.1, "what allocating alone maps"
    k = store._k
    store.reserve(kv)
    assert store._k is k, "once"
    store.offer(ids(23, 32), kv, 0, 32)
    assert store.reuse(ids(23, 32) + (1,), kv, 1) == 32 and torch.equal(kv.v[:, 1, :, :32], kv.v[:, 0, :, :32])
    off = PrefixCache(0)
    off.reserve(kv)
    assert off._k is None and off._v is None, "a disabled cache allocates nothing"


def test_slots_are_copied_in_runs_of_consecutive_ones():
    assert _runs([]) == []
    assert _runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs([5, 4]) == [(0, 5, 1), (1, 4, 1)], "descending slots are runs of one"
    assert _runs([7]) == [(0, 7, 1)]


def test_memory_is_bounded_by_the_capacity_whatever_is_offered(cache):
    store = PrefixCache(8 * BLOCK_TOKENS)
    for seed in range(40):
        store.offer(ids(100 + seed, 64), cache, 0, 64)
        assert store.stats().used_tokens <= 8 * BLOCK_TOKENS
    assert store._k is not None and store._k.shape[0] == 8  # the slots allocated once, never more


@pytest.mark.parametrize("tokens", [-16, 10, 17, 8200])
def test_a_capacity_that_is_not_whole_blocks_is_refused_by_name(tokens):
    with pytest.raises(ValueError, match=rf"prefix_cache_tokens must be 0 \(off\) or a multiple .* got {tokens}"):
        EngineConfig(prefix_cache_tokens=tokens)
