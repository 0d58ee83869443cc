"""The static KV cache, the prompt chunks written into it, and the attention masks over it.

`KVCache` holds keys and values as (layers, rows, KV heads, positions, D), allocated once for
`max_batch` rows of `max_context` positions. A row is one running sequence: position p of the row
holds the keys and values of the sequence's token p. The rows are kept packed (the scheduler owns
the rule, and each step's plan gives every sequence its row: scheduling/step_plan.py): rows 0..d-1
are the decoding
sequences, read as one batch by a decode step (`decode_mask`, one key range per row), and the rows
after them are still prefilling their prompts, a `PromptChunk` a step, each chunk attending over
its own row (`chunk_mask`). So attention reads views of the cache and never gathers; when a
sequence leaves or starts decoding, the scheduler keeps the packing with `move_row` and
`swap_rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from engine_service.model.config import ModelConfig

# (k_cache, v_cache, slots, k, v): layer_ops.LayerOps.write_kv's signature
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class KVCache(nn.Module):
    """Keys and values of every layer for `max_batch` rows of `max_context` tokens, allocated once
    (the row layout: the module docstring)."""

    def __init__(self, config: ModelConfig, max_batch: int, max_context: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        shape = (config.num_hidden_layers, max_batch, config.num_key_value_heads, max_context, config.dim_per_head)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_batch = max_batch
        self.max_context = max_context

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of row `src` into row `dst` (all layers)."""
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange rows `a` and `b` (their first `length_a` and `length_b` positions)."""
        for t in (self.k, self.v):
            kept = t[:, a, :, :length_a].clone()
            t[:, a, :, :length_b].copy_(t[:, b, :, :length_b])
            t[:, b, :, :length_a].copy_(kept)

    def decode_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(d * KV,): where `write_decode` puts row rows[i]'s key head h at positions[i], as an index
        into one layer's keys seen as (rows x KV heads x positions, D) vectors, i-major."""
        _, _, heads, context, _ = self.k.shape
        head = torch.arange(heads, device=rows.device)
        return ((rows[:, None] * heads + head[None, :]) * context + positions[:, None]).reshape(-1)

    def write_decode(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     write_kv: WriteKV | None = None) -> None:
        """Layer `layer`'s keys and values of d decoding rows, `k`/`v` (KV, d, D), at `slots`
        (`decode_slots`): in `write_kv` where given (model/layer_ops.py's, one call), else one
        index_copy_ each (an index_put_ on (rows, positions) took 9.1 us to its 4.9, traced, one
        row, 2 threads, Zen 4)."""
        if write_kv is not None:
            write_kv(self.k[layer], self.v[layer], slots, k, v)
            return
        dim = self.k.shape[-1]
        self.k[layer].view(-1, dim).index_copy_(0, slots, k.transpose(0, 1).reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, slots, v.transpose(0, 1).reshape(-1, dim))

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()


class PromptChunk(NamedTuple):
    """A run of one cache row's prompt tokens at positions start..start+length-1; the row's
    positions before `start` are already in the cache (an earlier chunk, or a reused prefix)."""

    row: int
    start: int
    length: int


def decode_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, L) with True where row b attends: keys 0..positions[b], L = the longest (a host
    sync): `rows_mask` of one token a row."""
    return rows_mask(positions[:, None])


def chunk_mask(chunk: PromptChunk, device: torch.device) -> torch.Tensor:
    """(T, start + T) with True where the chunk's token i attends: every cached position, and
    itself and the chunk's earlier tokens."""
    keys = torch.arange(chunk.start + chunk.length, device=device)
    queries = torch.arange(chunk.start, chunk.start + chunk.length, device=device)
    return keys[None, :] <= queries[:, None]


def rows_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, n, L) for B rows fed n tokens each at `positions` (B, n): True where a token attends,
    keys 0..its own position; L = the largest position + 1 (a host sync)."""
    length = int(positions.max()) + 1
    span = torch.arange(length, device=positions.device)
    return (span <= positions[..., None]).unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as scaled_dot_product_attention turns it for each call: 0 where
    True, -inf elsewhere, in the scores' `dtype`. The same bits out of attention (float32 and
    bfloat16, with and without enable_gqa), made once a step instead of once a layer: in a mixed
    step of SmolLM2 in bfloat16, 8 decoding rows beside a 150-token chunk at 1,000, the 60
    conversions (`aten::where`) took 5.4 ms of 109 (Xeon 207, torch profiler, 5 steps)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
