"""A request's life inside the engine: its tokens, its place in the KV cache, its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_service.generation.logprobs import TokenLogprobs
from engine_service.generation.output_text import OutputText
from engine_service.generation.speculative import NgramIndex
from engine_service.requests import Request

if TYPE_CHECKING:  # annotations only
    from engine_service.generation.constraint import Constraint
    from engine_service.generation.logits_processors import Penalties


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


@dataclass
class Timings:
    accepted: float = field(default_factory=time.monotonic)
    prefill_started: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(eq=False)
class Sequence:
    """Mutable; after admission only the decode loop thread touches it, except `cancelled`,
    which the event loop sets (a single attribute store, atomic under the GIL)."""

    request: Request
    sink: object  # engine.TokenStream, opaque here
    # trace_id/span_id of the request's server span, for events logged about it off the request's
    # context (the decode loop thread, the stall watch): contextvars do not cross threads
    trace: dict[str, str] = field(default_factory=dict)
    generated: list[int] = field(default_factory=list)
    cache_len: int = 0  # tokens whose keys and values are in the cache
    cached_tokens: int = 0  # of the prompt's, those copied from the prefix cache
    admitted: int = -1  # the scheduler's admission count when it took this sequence (prefill order)
    generator: torch.Generator | None = None
    timings: Timings = field(default_factory=Timings)
    cancelled: bool = False
    ngram: NgramIndex | None = None  # its text's n-grams, once speculation drafts for it (speculator.py)
    draft_tokens: int = 0  # speculated tokens verified for it
    accepted_tokens: int = 0  # of those, accepted
    text: OutputText | None = None  # its streamed text and stop strings (set when submitted)
    constraint: Constraint | None = None  # its response_format's matcher (compiled when it arrived)
    penalties: Penalties | None = None  # the tokens seen, once it starts, when its sampling penalizes them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # echo_prompt_logprobs, chunk by chunk

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_len(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)

    def finish_reason(self, token: int, end_token_ids: frozenset[int]) -> FinishReason | None:
        """Why the sequence ends after producing `token` (already appended, its text pushed and
        its constraint advanced), or None."""
        if token in self.request.stop_token_ids:
            return FinishReason.STOP
        if self.text is not None and self.text.stop_string is not None:
            return FinishReason.STOP
        if self.constraint is not None and self.constraint.done:
            return FinishReason.STOP
        if token in end_token_ids and not self.request.ignore_eos:
            return FinishReason.EOS
        if len(self.generated) >= self.request.max_new_tokens:
            return FinishReason.LENGTH
        return None
