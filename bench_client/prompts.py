"""Prompts as token ids of an exact length, reproducible from a seed.

A prompt is a shared prefix followed by a unique part (vLLM's `--random-prefix-len`):
- the prefix, `prefix_tokens` long, depends only on (seed, prefix group): every request of a group
  starts with the same tokens, across all points of the sweep, as a common system prompt would. A
  shorter prefix of the same group is the start of a longer one.
- the unique part, `length - prefix_tokens` long, depends only on (seed, point, length, index), where
  `point` names the sweep point (PointSpec.tag(): its context, new tokens, concurrency, rate and
  prefix). So no point is served from a prefix cache by an earlier point's prompts: only the
  prefix is shared, on purpose. The server is not part of it: servers compared side by side in one
  sweep get the same prompts at the same point.

So a resumed or reordered sweep sends the same prompts. With `prefix_tokens = 0` (the default) no
two requests of a sweep share a prefix beyond chance (their first tokens are independent draws, so
two of them agree on a first token with probability 1/vocab): no accidental prefix-cache hits.
With `prefix_tokens = length` the unique part is empty and the requests of a group send one prompt.
"""

from __future__ import annotations

import random
from collections.abc import Collection


def make_prompt(*, seed: int, length: int, index: int, vocab_size: int, avoid: Collection[int] = (),
                prefix_tokens: int = 0, prefix_group: int = 0, point: str = "") -> tuple[int, ...]:
    """`length` token ids in [0, vocab_size), none of them in `avoid` (EOS, BOS): the prefix of
    `prefix_group` (`prefix_tokens` long), then the unique tokens of (point, length, index)."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length!r}")
    if not 0 <= prefix_tokens <= length:
        raise ValueError(f"prefix_tokens must be in 0..length {length!r}, got {prefix_tokens!r}")
    if prefix_group < 0:
        raise ValueError(f"prefix_group must be >= 0, got {prefix_group!r}")
    allowed = vocab_size - len({t for t in avoid if 0 <= t < vocab_size})
    if allowed < 1:
        raise ValueError(f"vocab_size {vocab_size!r} leaves no token id outside {sorted(avoid)!r}")
    prefix = _draw(random.Random(f"{seed}:prefix:{prefix_group}"), prefix_tokens, vocab_size, avoid)
    unique_seed = f"{seed}:{point}:{length}:{index}" if point else f"{seed}:{length}:{index}"
    unique = _draw(random.Random(unique_seed), length - prefix_tokens, vocab_size, avoid)
    return prefix + unique


def _draw(rng: random.Random, count: int, vocab_size: int, avoid: Collection[int]) -> tuple[int, ...]:
    ids: list[int] = []
    while len(ids) < count:
        token = rng.randrange(vocab_size)
        if token not in avoid:
            ids.append(token)
    return tuple(ids)
