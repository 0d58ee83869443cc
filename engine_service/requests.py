"""Frozen domain requests, parsed once at the boundary; the engine trusts them.

`Request.parse` reads a DecodeRequest message by attribute (it never imports generated code)
and raises InvalidField or ContextLengthExceeded naming the field and the value.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from shared.errors import ContextLengthExceeded, InvalidField

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TEMPERATURE = 100.0


class Encoder(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    """What the boundary enforces, from the engine's configuration."""

    vocab_size: int
    max_context_tokens: int
    max_new_tokens_limit: int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    deadline: float | None  # time.monotonic() seconds, or None

    @classmethod
    def parse(cls, msg: Any, limits: Limits, tokenizer: Encoder, deadline: float | None) -> Request:
        request_id = msg.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if not REQUEST_ID.fullmatch(request_id):
            raise InvalidField(
                "request_id", request_id,
                f"request_id must be 1..128 characters of [A-Za-z0-9._:-], got {request_id[:140]!r}",
            )
        max_new = msg.max_new_tokens
        prompt = _parse_prompt(msg, limits, tokenizer)
        if not 1 <= max_new <= limits.max_new_tokens_limit:
            raise InvalidField(
                "max_new_tokens", max_new, f"max_new_tokens must be 1..{limits.max_new_tokens_limit}, got {max_new}"
            )
        if len(prompt) + max_new > limits.max_context_tokens:
            raise ContextLengthExceeded.build(len(prompt), max_new, limits.max_context_tokens)
        stops = tuple(msg.stop_token_ids)
        for token in stops:
            if token >= limits.vocab_size:
                raise InvalidField(
                    "stop_token_ids", token, f"stop_token_ids must be < vocab_size {limits.vocab_size}, got {token}"
                )
        return cls(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new,
            sampling=_parse_sampling(msg.sampling),
            stop_token_ids=frozenset(stops),
            ignore_eos=msg.ignore_eos,
            deadline=deadline,
        )


def _parse_prompt(msg: Any, limits: Limits, tokenizer: Encoder) -> tuple[int, ...]:
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidField("prompt", None, "prompt must be set: give prompt_text or prompt_token_ids")
    if which == "prompt_text":
        text = msg.prompt_text
        if not text:
            raise InvalidField("prompt_text", text, "prompt_text must not be empty, got ''")
        # A cheap bound before tokenizing on the event loop: no tokenizer makes fewer tokens than
        # characters / 64, so promptTokens is then a lower bound.
        if len(text) > 64 * limits.max_context_tokens:
            at_least = len(text) // 64
            raise ContextLengthExceeded(
                f"prompt_text of {len(text)} characters is at least {at_least} tokens, more than max_context_tokens "
                f"{limits.max_context_tokens}",
                metadata={"promptTokens": at_least, "maxNewTokens": msg.max_new_tokens,
                          "maxContextTokens": limits.max_context_tokens},
            )
        return tuple(tokenizer.encode(text))
    ids = tuple(msg.prompt_token_ids.ids)
    if not ids:
        raise InvalidField("prompt_token_ids.ids", [], "prompt_token_ids.ids must not be empty, got []")
    if len(ids) > limits.max_context_tokens:
        raise ContextLengthExceeded.build(len(ids), msg.max_new_tokens, limits.max_context_tokens)
    largest = max(ids)
    if largest >= limits.vocab_size:
        index = ids.index(largest)
        raise InvalidField(
            "prompt_token_ids.ids", largest,
            f"prompt_token_ids.ids[{index}] must be < vocab_size {limits.vocab_size}, got {largest}",
        )
    return ids


def _parse_sampling(sampling: Any) -> SamplingParams:
    temperature = sampling.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise InvalidField(
            "sampling.temperature", temperature,
            f"sampling.temperature must be finite and in [0, {MAX_TEMPERATURE:g}], got {temperature}",
        )
    top_p = sampling.top_p if sampling.top_p != 0.0 else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidField("sampling.top_p", sampling.top_p, f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidField("sampling.top_k", sampling.top_k, f"sampling.top_k must be >= 0, got {sampling.top_k}")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=sampling.top_k, seed=sampling.seed)
