"""Reading one streamed answer of an OpenAI-compatible server: its server-sent events in, Chunks
out (pure; the HTTP adapter, bench_client/openai_http.py, feeds it the events as they arrive).

- one Chunk per event that carries a choice: `choices[0].text` (chat: `delta.content`, so that TTFT
  is the first content delta's), received_at when its bytes arrived, num_tokens the tokens it
  carried: the length of its `logprobs` when it has them, else 1 (the servers send one event per
  sampled token, or several tokens in one: llama-server holds back a token behind a partial stop
  word or inside a UTF-8 character and sends it with the next; the server's usage is the count),
  and 0 for the event that only closes the choice (a `finish_reason` with no text);
- the last Chunk carries the finish_reason ("length" -> LENGTH, "stop" -> EOS, or STOP where the
  server says a stop string matched: vLLM's `stop_reason`, SGLang's `matched_stop`) merged with
  the usage and `timings` that came with it or after it (OpenAI's usage-only event, `choices: []`):
  prompt_tokens, completion_tokens (the server's count), cached_prompt_tokens
  (`usage.prompt_tokens_details.cached_tokens`, or llama-server's `timings.cache_n`) and
  server_timings;
- `data: [DONE]` ends the answer. An error frame (`data: {"error": ...}`) raises StreamError, after
  the chunks before it (this engine's frame raises its reason's class: SequenceError,
  EngineDraining...; one that is the answer's first event, before any token, is classified by
  `from_first_error_frame`: TGI refuses a streamed request so, top_p 1.0 included); an event whose
  data is not a JSON object raises StreamError (http_status 200).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

from bench_client.openai_errors import from_error_frame, from_first_error_frame, json_int, malformed_event
from bench_client.server_api import Chunk
from bench_client.sse import Event
from shared.errors import StreamError


class StreamReader:
    """The events of one answer in, Chunks out (pure): holds the chunk that closes the choice until
    the usage after it (or [DONE], or the end) arrives, so that the last Chunk carries both."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.done = False
        self.output_tokens = 0
        self.usage_input_tokens: int | None = None
        self.cached_tokens: int | None = None
        self._ended = False
        self._final: Chunk | None = None
        self._usage: Mapping[str, Any] | None = None
        self._timings: Mapping[str, Any] | None = None

    def on_event(self, event: Event, received_at: float) -> list[Chunk]:
        if self.done:
            return []
        data = event.data.strip()
        if data == "[DONE]":
            self.done = True
            return self.end()
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            raise malformed_event(event.data, "data is not JSON") from None
        if not isinstance(message, Mapping):
            raise malformed_event(event.data, "data is not a JSON object")
        if "error" in message or event.event == "error":
            if self.output_tokens == 0 and self._final is None:  # before any token: TGI's refusals
                raise from_first_error_frame(message)
            raise from_error_frame(message)
        if isinstance(message.get("usage"), Mapping):
            self._usage = message["usage"]
        if isinstance(message.get("timings"), Mapping):
            self._timings = message["timings"]
        choices = message.get("choices")
        if choices is None and "usage" not in message:
            raise malformed_event(event.data, "an event without choices")
        if not isinstance(choices, list) or not choices:
            return []  # the usage-only event (choices: []): merged into the final chunk
        choice = choices[0]
        if not isinstance(choice, Mapping):
            raise malformed_event(event.data, "a choice that is not an object")
        text, tokens = self._text_and_tokens(choice)
        finish = finish_reason(choice)
        out: list[Chunk] = []
        if self._final is not None:  # more after the closing chunk (several choices?): keep it as it is
            out.append(self._final)
            self._final = None
        self.output_tokens += tokens
        chunk = Chunk(received_at=received_at, num_tokens=tokens, text=text, finish_reason=finish,
                      prompt_tokens=None, completion_tokens=None, timing=None)
        if finish is not None:
            self._final = chunk
        elif tokens or text:
            out.append(chunk)
        return out

    def _text_and_tokens(self, choice: Mapping[str, Any]) -> tuple[str, int]:
        if self.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content") if isinstance(delta, Mapping) else None
            text = text if isinstance(text, str) else ""
            carries = bool(text) or (isinstance(delta, Mapping) and bool(
                delta.get("reasoning_content") or delta.get("tool_calls")))
        else:
            text = choice.get("text")
            text = text if isinstance(text, str) else ""
            carries = bool(text) or not choice.get("finish_reason")
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, Mapping):
            for key in ("tokens", "content"):  # legacy completions (vLLM); chat and llama-server
                if isinstance(logprobs.get(key), list):
                    return text, len(logprobs[key])
        return text, 1 if carries else 0

    def end(self) -> list[Chunk]:
        """The end of the answer ([DONE] or the end of the body): the held final chunk, with usage."""
        self.done = True
        if self._ended:
            return []
        self._ended = True
        final, self._final = self._final, None
        if final is None and self._usage is None:
            return []
        usage = self._usage or {}
        timings = _numbers(self._timings)
        prompt_tokens = json_int(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = json_int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        if cached is None and self._timings is not None:
            cached = json_int(self._timings.get("cache_n"))
        self.usage_input_tokens = prompt_tokens
        self.cached_tokens = cached
        return [Chunk(
            received_at=final.received_at if final is not None else time.perf_counter(),
            num_tokens=final.num_tokens if final is not None else 0,
            text=final.text if final is not None else "",
            finish_reason=final.finish_reason if final is not None else None,
            prompt_tokens=prompt_tokens, completion_tokens=json_int(usage.get("completion_tokens")),
            timing=None, cached_prompt_tokens=cached, server_timings=timings,
        )]


def finish_reason(choice: Mapping[str, Any]) -> str | None:
    """The domain finish reason of a choice: LENGTH, EOS, STOP (a stop string matched, where the
    server says so), None while it goes on; "abort" (vLLM's engine aborted it) raises StreamError."""
    raw = choice.get("finish_reason")
    if raw is None or raw == "":  # TGI's streamed completions may say "" while the answer goes on
        return None
    if raw == "length":
        return "LENGTH"
    if raw == "stop":
        # vLLM: stop_reason None (EOS) or the stop token id / string; SGLang: matched_stop id or string
        matched = choice.get("stop_reason", choice.get("matched_stop"))
        return "STOP" if isinstance(matched, str) else "EOS"
    if raw == "eos_token":  # TGI
        return "EOS"
    if raw in ("stop_sequence", "tool_calls", "function_call", "content_filter"):
        return "STOP"
    if raw in ("abort", "error"):
        err = StreamError(f"the server ended the answer with finish_reason {raw!r}",
                          metadata={"httpStatus": 200, "finishReason": raw})
        err.http_status = 200
        raise err
    return str(raw).upper()


def _numbers(value: Mapping[str, Any] | None) -> dict[str, float] | None:
    """The finite numbers of a `timings` object (NaN, Infinity and integers past a float's range are
    no figures)."""
    if not value:
        return None
    numbers: dict[str, float] = {}
    for key, item in value.items():
        if isinstance(item, int | float) and not isinstance(item, bool):
            try:
                number = float(item)
            except OverflowError:  # an integer of hundreds of digits
                continue
            if math.isfinite(number):
                numbers[key] = number
    return numbers
