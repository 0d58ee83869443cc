"""A request's life inside the engine: its tokens, its place in the KV cache, its timings, and its
generation controls (generation/controls.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine_service.generation.controls import Controls
from engine_service.requests import Request


@dataclass
class Timings:
    accepted: float = field(default_factory=time.monotonic)
    prefill_started: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(frozen=True)
class PromptSlice:
    """A prompt chunk of `length` tokens from the sequence's cache_len on, in flight through the
    model's layers over several steps (a layer-sliced prefill: scheduling/prefill_budget.py): its
    sublayers 0..sublayers_run-1 have run (step_plan.SublayerSpan), and sublayer sublayers_run's
    rows 0..rows_run-1, and their keys and values are in its row."""

    length: int
    sublayers_run: int = 0
    rows_run: int = 0


@dataclass(eq=False)
class Sequence:
    """Mutable; after admission only the decode loop thread touches it, except `cancelled`,
    which the event loop sets (a single attribute store, atomic under the GIL)."""

    request: Request
    sink: object  # runtime.engine.TokenStream, opaque here
    # trace_id/span_id of the request's server span, for events logged about it off the request's
    # context (the decode loop thread, the stall watch): contextvars do not cross threads
    trace: dict[str, str] = field(default_factory=dict)
    generated: list[int] = field(default_factory=list)
    cache_len: int = 0  # tokens whose keys and values are in the cache
    cached_tokens: int = 0  # of the prompt's, those copied from the prefix cache
    slice: PromptSlice | None = None  # its prompt chunk in flight through the layers, if any
    admitted: int = -1  # the scheduler's admission count when it took this sequence (prefill order)
    timings: Timings = field(default_factory=Timings)
    cancelled: bool = False
    controls: Controls = None  # type: ignore[assignment]  # built from the request when not given

    def __post_init__(self) -> None:
        if self.controls is None:
            self.controls = Controls(self.request)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def kv_len(self) -> int:
        """The positions of its row that hold keys and values, in some layers at least: cache_len,
        and a chunk in flight through the layers (what a row move must carry)."""
        return self.cache_len + (self.slice.length if self.slice is not None else 0)

    @property
    def total_len(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)
