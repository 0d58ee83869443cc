"""Prompts as token ids of an exact length, reproducible from a seed.

Each prompt depends only on (seed, length, index), so a resumed or reordered sweep sends the same
prompts, and no two requests of a point share a prefix (no accidental prefix-cache hits).
"""

from __future__ import annotations

import random
from collections.abc import Collection


def make_prompt(*, seed: int, length: int, index: int, vocab_size: int,
                avoid: Collection[int] = ()) -> tuple[int, ...]:
    """`length` token ids in [0, vocab_size), none of them in `avoid` (EOS, BOS)."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length!r}")
    allowed = vocab_size - len({t for t in avoid if 0 <= t < vocab_size})
    if allowed < 1:
        raise ValueError(f"vocab_size {vocab_size!r} leaves no token id outside {sorted(avoid)!r}")
    rng = random.Random(f"{seed}:{length}:{index}")
    ids: list[int] = []
    while len(ids) < length:
        token = rng.randrange(vocab_size)
        if token not in avoid:
            ids.append(token)
    return tuple(ids)
