"""Automatic prefix caching: computed keys and values of full blocks of prompt tokens, reused by
later prompts that start with the same tokens (`--prefix-cache-tokens`, 0 turns it off).

A block is BLOCK_TOKENS tokens at fixed positions (block i holds positions i*B..i*B+B-1). It is
indexed by its parent block and its own tokens, so a block names its whole prefix, as vLLM's hash
chained over the blocks does; here the key holds the parent's identity and the tokens themselves,
so two different prefixes can never share an entry (no hash collision to trust).

The KV cache keeps running sequences in packed rows (attention reads views, never gathers), so a
hit is a copy: the matched blocks' keys and values are copied into the admitted sequence's row,
and only the rest of its prompt is prefilled, at a position offset. Copying costs a few
milliseconds for a thousand tokens, far below computing them.

The store is a fixed number of block slots, allocated and written once when the engine starts
(`reserve`), so that no step pays for its pages: on a VM the first write into fresh pages is dear
(an AMD EPYC of the Zen 4 class under KVM, a 2,000-token prompt's blocks of SmolLM2, 46 MB: 58-118
ms into slots never written, 5-9 ms into slots written before), and the copy runs inside the step
that completes the prompt, while the decoding streams wait; the engine's 8,192-token store of
SmolLM2 (180 MB) took 0.26 s to write at start-up there. Resident memory is the capacity from the
start (as the KV cache's budget counts it). When it is full, the
least recently used block that no other block extends is evicted first (a block's descendants are
never newer than it: a lookup touches a chain leaf first), and a block pinned by the chain being
read or written is never evicted under it.

Only the decode loop thread calls this; `stats` is read through the published LoadSnapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_service.model.kv_cache import KVCache

_ROOT = 0  # the parent id of a prompt's first block

# Tokens per prefix-cache block (vLLM's default block size): a prompt's prefix is reused in whole blocks.
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class PrefixCacheStats:
    used_tokens: int = 0
    capacity_tokens: int = 0
    queried_tokens: int = 0  # prompt tokens looked up, since start-up
    hit_tokens: int = 0  # of those, tokens whose keys and values were reused


@dataclass(eq=False)
class _Block:
    id: int
    slot: int
    key: tuple[int, tuple[int, ...]]  # (parent id, tokens)
    parent: _Block | None
    children: int = 0
    pins: int = 0


class PrefixCache:
    """A bounded store of full blocks' keys and values; `capacity_tokens` (whole blocks, as
    EngineConfig validates it) 0 makes every call a no-op."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = capacity_tokens // BLOCK_TOKENS
        self._index: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # oldest first
        self._free = list(range(self.capacity_blocks - 1, -1, -1))
        self._next_id = _ROOT + 1
        self._k: torch.Tensor | None = None  # (slots, layers, KV heads, B, D): `reserve`, else on first store
        self._v: torch.Tensor | None = None
        self._queried = 0
        self._hits = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(len(self._lru) * BLOCK_TOKENS, self.capacity_blocks * BLOCK_TOKENS, self._queried,
                                self._hits)

    def reserve(self, cache: KVCache) -> None:
        """Allocate the store for blocks of `cache` and write every slot once, so that its pages are
        resident before a step copies into them (module docstring). Nothing when disabled."""
        if self.enabled and self._k is None:
            self._allocate(cache)
            for store in (self._k, self._v):
                store.zero_()  # type: ignore[union-attr]

    def _allocate(self, cache: KVCache) -> None:
        layers, _, heads, _, dim = cache.k.shape
        shape = (self.capacity_blocks, layers, heads, BLOCK_TOKENS, dim)
        self._k = torch.empty(shape, dtype=cache.k.dtype, device=cache.k.device)
        self._v = torch.empty(shape, dtype=cache.v.dtype, device=cache.v.device)

    def reuse(self, prompt: Sequence[int], cache: KVCache, row: int) -> int:
        """Copy the longest cached prefix of `prompt` into `row` of `cache` (positions from 0) and
        return its length in tokens: whole blocks, and never the prompt's last token, whose logits
        the prefill must compute."""
        if not self.enabled:
            return 0
        chain = self._walk(prompt, (len(prompt) - 1) // BLOCK_TOKENS)
        self._queried += len(prompt)
        if not chain:
            return 0
        self._hits += len(chain) * BLOCK_TOKENS
        k, v = self._k, self._v
        assert k is not None and v is not None  # a block exists, so the store was allocated
        layers, _, heads, _, dim = cache.k.shape
        for at, slot, count in _runs([b.slot for b in chain]):
            span = slice(at * BLOCK_TOKENS, (at + count) * BLOCK_TOKENS)
            for store, target in ((k, cache.k), (v, cache.v)):  # (n, layers, KV, B, D) -> (layers, KV, n*B, D)
                target[:, row, :, span].view(layers, heads, count, BLOCK_TOKENS, dim).copy_(
                    store[slot:slot + count].permute(1, 2, 0, 3, 4))
        self._touch(chain)
        return len(chain) * BLOCK_TOKENS

    def offer(self, tokens: Sequence[int], cache: KVCache, row: int, length: int) -> None:
        """Store the full blocks of `tokens[:length]`, whose keys and values are in `row` of
        `cache`, that are not stored yet; evict to make room, and stop when nothing can be evicted."""
        if not self.enabled:
            return
        chain = self._walk(tokens, length // BLOCK_TOKENS)
        for block in chain:  # pinned: making room for this chain's new blocks never evicts its own
            block.pins += 1
        new: list[_Block] = []
        first_new = len(chain)
        try:
            for i in range(len(chain), length // BLOCK_TOKENS):
                slot = self._free.pop() if self._free else self._evict()
                if slot is None:
                    break
                parent = chain[-1] if chain else None
                block = _Block(self._next_id, slot, (_ROOT if parent is None else parent.id,
                                                     tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])), parent)
                self._next_id += 1
                self._index[block.key] = block
                if parent is not None:
                    parent.children += 1
                block.pins += 1
                chain.append(block)
                new.append(block)
        finally:
            for block in chain:
                block.pins -= 1
        if new:
            self._store(new, cache, row, first_new * BLOCK_TOKENS)
        self._touch(chain)

    def _walk(self, tokens: Sequence[int], blocks: int) -> list[_Block]:
        """The stored blocks matching tokens' first `blocks` blocks, longest chain from the start."""
        chain: list[_Block] = []
        parent = _ROOT
        for i in range(blocks):
            block = self._index.get((parent, tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        """Most recently used: the chain's leaf first, so that each ancestor is newer than its descendants."""
        for block in reversed(chain):
            self._lru.pop(block.id, None)
            self._lru[block.id] = block

    def _evict(self) -> int | None:
        """Free the least recently used block that nothing extends and nothing pins; its slot, or None."""
        victim = next((b for b in self._lru.values() if b.children == 0 and b.pins == 0), None)
        if victim is None:
            return None
        del self._lru[victim.id]
        del self._index[victim.key]
        if victim.parent is not None:
            victim.parent.children -= 1
        return victim.slot

    def _store(self, blocks: list[_Block], cache: KVCache, row: int, start: int) -> None:
        """Copy consecutive blocks, the first at position `start`, from `row` into their slots."""
        layers, _, heads, _, dim = cache.k.shape
        if self._k is None:  # not reserved (a test's store)
            self._allocate(cache)
        for at, slot, count in _runs([b.slot for b in blocks]):
            first = start + at * BLOCK_TOKENS
            for store, source in ((self._k, cache.k), (self._v, cache.v)):
                part = source[:, row, :, first:first + count * BLOCK_TOKENS]
                store[slot:slot + count].copy_(  # type: ignore[index]
                    part.reshape(layers, heads, count, BLOCK_TOKENS, dim).permute(2, 0, 1, 3, 4))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """`slots` as runs of consecutive ascending ones: (index of the run's first in `slots`, its slot,
    its length). A run is one strided copy. Indexing the store by a tensor of slots instead (torch's
    index and index_put) took, for a 2,000-token prompt's blocks of SmolLM2 (46 MB), 28-33 ms to
    reuse and 6 ms to store, against 4.5 and 4 ms in runs, and 5.7 ms to store with every slot a
    run of its own (AMD EPYC of the Zen 4 class, 2 threads; a store into slots never written before
    takes 13-17 ms either way, the pages' first touch)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            at, first, count = runs[-1]
            runs[-1] = (at, first, count + 1)
        else:
            runs.append((i, slot, 1))
    return runs

