"""How many prompt tokens a step may prefill beside the decoding rows, from the step times the
decode loop sees (`--max-prefill-tokens auto`, the default), so that the bound holds on any CPU:
a step that prefills takes at most `STALL_FACTOR` times a decode-only step.

Two costs are tracked, each a moving average of the loop's own measurements:
- a decode-only step's seconds, per number of decoding rows (steps that prefill nothing);
- the seconds per prompt token of a step that prefills: (step - decode-only step at the same
  rows) / tokens. Before any such step has been seen beside decoding rows, the cost of an idle
  prefill (whole prompts, larger and cheaper matmuls) doubled stands in for it.

The budget with d rows decoding is then (STALL_FACTOR - 1) x decode step(d) / seconds per token:
the streams' gap while a long prompt prefills is about STALL_FACTOR of their TPOT (target: <= 4x)
and the prompt's TTFT about 1 + 1 / (STALL_FACTOR - 1) of its TTFT alone (target: <= 1.6x), give
or take what a chunk costs more than a whole prompt's token. A fixed `--max-prefill-tokens N`
turns all this off. A token count tuned on one CPU does not travel: 96 tokens kept the gap at
3.7x a TPOT on a Xeon with AMX, and 10.4x on an EPYC with AVX2.
"""

from __future__ import annotations

STALL_FACTOR = 3.0
MIN_TOKENS = 16  # one prefix-cache block: a smaller chunk costs its per-step overhead for little
START_TOKENS = 96  # before the loop has timed a decode-only step and a prefill
SMOOTHING = 0.3  # weight of the newest measurement in each moving average
IDLE_PRIOR = 2.0  # a chunk beside decoding rows is taken to cost this many idle-prefill tokens until timed


class PrefillBudget:
    def __init__(self, fixed: int | None, max_tokens: int) -> None:
        self.fixed = fixed
        self.max_tokens = max_tokens
        self._decode: dict[int, float] = {}  # decoding rows -> seconds of a decode-only step
        self._token_mixed: float | None = None  # seconds per prompt token, beside decoding rows
        self._token_idle: float | None = None  # seconds per prompt token, nothing decoding

    def tokens(self, decoding: int) -> int:
        """The budget of a step with `decoding` rows decoding (> 0; an idle step has its own rule)."""
        if self.fixed is not None:
            return self.fixed
        decode = self._decode_seconds(decoding)
        per_token = self._token_mixed if self._token_mixed is not None else (
            None if self._token_idle is None else self._token_idle * IDLE_PRIOR)
        if decode is None or per_token is None or per_token <= 0:
            return START_TOKENS
        return max(MIN_TOKENS, min(self.max_tokens, int((STALL_FACTOR - 1) * decode / per_token)))

    def observe(self, decoding: int, prefill_tokens: int, seconds: float) -> None:
        """A step took `seconds` with `decoding` rows decoding and `prefill_tokens` prompt tokens."""
        if prefill_tokens == 0:
            if decoding:
                self._decode[decoding] = _average(self._decode.get(decoding), seconds)
            return
        if decoding == 0:
            self._token_idle = _average(self._token_idle, seconds / prefill_tokens)
            return
        decode = self._decode_seconds(decoding)
        if decode is not None:
            self._token_mixed = _average(self._token_mixed, max(seconds - decode, 0.0) / prefill_tokens)

    def _decode_seconds(self, decoding: int) -> float | None:
        """A decode-only step's time at `decoding` rows, or at the nearest row count timed."""
        if decoding in self._decode:
            return self._decode[decoding]
        if not self._decode:
            return None
        return self._decode[min(self._decode, key=lambda rows: (abs(rows - decoding), rows))]

    def describe(self) -> dict[str, float | int | None]:
        """The estimates, for logs."""
        return {"fixed": self.fixed, "token_ms_mixed": _ms(self._token_mixed), "token_ms_idle": _ms(self._token_idle),
                "decode_ms": {rows: _ms(s) for rows, s in sorted(self._decode.items())}}  # type: ignore[dict-item]


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
