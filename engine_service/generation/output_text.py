"""A sequence's output text as it is streamed, and its stop strings (DecodeRequest.stop).

Each generated token's text comes from the tokenizer's stream decoder (which already holds back
the bytes of an incomplete UTF-8 character). Of that text, `push` releases what can be streamed:
everything except a tail that is the start of some stop string (it may still become one) — as
llama-server holds back only a possible partial match. When a stop string appears (across token
boundaries, or starting inside one token's text), the text is cut at its first character and
nothing after it is released; `stop_string` names the one matched: the earliest in the text, and
of several starting at the same character the first listed. `flush` releases the held-back tail
once generation ends for another reason (it never became a match).

Only the text is held back here: the token ids are streamed as they are made (proto/engine.proto).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_service.model.loader import StreamDecoder


class OutputText:
    def __init__(self, decoder: StreamDecoder, stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stop = tuple(stop)
        self._held = ""  # decoded, not yet released: the start of a stop string, possibly
        self.stop_string: str | None = None  # the stop string matched, once one has

    def push(self, token: int) -> str:
        """The text that `token` releases (possibly empty). Nothing once a stop string matched."""
        if self.stop_string is not None:
            return ""
        text = self._decoder.step((token,))
        if not self._stop:
            return text
        held = self._held + text
        match = _earliest(held, self._stop)
        if match is not None:
            at, self.stop_string = match
            self._held = ""
            return held[:at]
        keep = _partial_tail(held, self._stop)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]

    def flush(self) -> str:
        """The held-back tail, released because generation ended without it becoming a match."""
        held, self._held = self._held, ""
        return held


def _earliest(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text`; the first listed wins a tie."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def _partial_tail(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
