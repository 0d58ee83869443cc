"""The engine's answer in OpenAI's shapes (pure): completion and chat objects, their stream chunks,
each endpoint's form of log-probabilities, and the usage.

Finish reasons: `length` when max_tokens ended it, `stop` for EOS, a stop token, a stop string or a
completed response_format; `stop_reason` says which stop string or token, as vLLM's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_service.generation.controls import FinishReason
from engine_service.generation.logprobs import TokenLogprobs
from engine_service.transport.openai_request import OpenAICall

Piece = Callable[[int], str]
FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Shaper:
    """The objects of one answer: the same id, creation time and model in every chunk."""

    def __init__(self, call: OpenAICall, request_id: str, model: str, piece: Piece) -> None:
        self.call = call
        chat = call.endpoint == "chat"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.model = model
        self.piece = piece
        self._offset = 0  # completions' text_offset: characters of text before the next token

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- log-probabilities ---------------------------------------------------------------------
    def logprobs(self, values: Sequence[TokenLogprobs], prompt: Sequence[TokenLogprobs] = (),
                 first_prompt_token: int | None = None) -> dict[str, Any] | None:
        """This endpoint's form for `values` (None when none were asked). Completions with echo:
        the prompt's tokens first, the first one without a log-probability, as vLLM answers."""
        if not self.call.logprobs:
            return None
        if self.call.endpoint == "chat":
            return {"content": [self._chat_entry(v) for v in values]}
        tokens: list[str] = []
        chosen: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        entries: list[tuple[str, float | None, dict[str, float] | None]] = []
        if first_prompt_token is not None:
            entries.append((self.piece(first_prompt_token), None, None))
        for v in (*prompt, *values):
            top = {self.piece(t): lp for t, lp in v.top[:self.call.alternatives]}
            entries.append((self.piece(v.token_id), v.logprob, top))
        for text, logprob, top in entries:
            tokens.append(text)
            chosen.append(logprob)
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, v: TokenLogprobs) -> dict[str, Any]:
        text = self.piece(v.token_id)
        return {"token": text, "logprob": v.logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": self.piece(t), "logprob": lp, "bytes": list(self.piece(t).encode("utf-8"))}
                                 for t, lp in v.top[:self.call.alternatives]]}

    # -- whole answers ---------------------------------------------------------------------------
    def whole(self, text: str, finish: FinishReason, stop_reason: str | int | None, logprobs: dict[str, Any] | None,
              usage: Usage) -> dict[str, Any]:
        if self.call.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": logprobs, "finish_reason": FINISH[finish], "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": FINISH[finish],
                      "stop_reason": stop_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage.json()}

    # -- stream chunks ---------------------------------------------------------------------------
    def chunk(self, text: str, logprobs: dict[str, Any] | None = None, finish: FinishReason | None = None,
              stop_reason: str | int | None = None, *, first: bool = False) -> dict[str, Any]:
        """One chunk of a stream; chat's first carries the role."""
        finish_reason = FINISH[finish] if finish is not None else None
        if self.call.endpoint == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text or finish is None else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        if finish is not None:
            choice["stop_reason"] = stop_reason
        chunk = {**self._head(obj), "choices": [choice]}
        if self.call.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.call.endpoint == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage.json()}
