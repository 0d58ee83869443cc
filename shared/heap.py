"""The start-up heap, kept out of the garbage collector's full passes.

A full (oldest-generation) collection scans every object the collector tracks, holding the GIL. A
served SmolLM2 engine tracks about 394,000 once built (torch's modules and their tensors' Python
objects, tokenizer tables, every imported module), and one full pass over them took 125-138 ms
(Xeon 207 with AMX): every stream's next token waits for it, and a bench client's clocks stop
for it in the middle of a measurement (the client's own passes took up to 116 ms in
benchmarks/chunked_prefill.py). CPython starts a full pass whenever the objects that have
survived into the oldest generation since the last one pass a quarter of those already there, so
a long-running server or sweep meets one every so often. `gc.freeze()` moves everything tracked
into a permanent generation that no pass scans (a full pass right after it: under 0.1 ms); what is
made afterwards is collected as before, and reference counting frees frozen objects as ever: only
cycles among them wait for `gc.unfreeze()`."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect once, then keep every object tracked now out of later passes until the block ends
    (its objects go back to the oldest generation then, so a caller in a longer process, a test,
    leaves no cycle uncollectable). Yields how many objects were frozen, for the log."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
