"""How many prompt tokens a step may prefill beside the decoding rows, from the step times the
decode loop sees (`--max-prefill-tokens auto`, the default), so that the bound holds on any CPU:
a step that prefills takes about `STALL_FACTOR` times a decode-only step, no more.

What the loop measures, as moving averages and a feedback:
- a decode-only step's seconds, per number of decoding rows (steps that prefill nothing);
- each step that prefills beside decoding rows: its excess over the decode-only step at the same
  rows. The next budget is this one scaled by sqrt(target excess / measured excess), at most
  doubling, where the target excess is (STALL_FACTOR - 1) decode-only steps: a feedback on the
  step time itself, not a cost per token. A step's excess is not proportional to its tokens: a
  chunk late in a long prompt attends to every cached position, and a step that prefills leaves
  the decode rows' quantized kernels for the full weights, so on SmolLM2 with 8 rows decoding a
  24-token chunk at position 1,900 cost 94 ms over the 51 ms decode step, and a 78-token chunk at
  846 cost 98 ms. A per-token estimate shrank the chunks as the prompt grew, each paying that
  fixed part again (the long prompt's TTFT 1.62x its TTFT alone); the feedback keeps each step at
  the target instead.
- Before any such step: the cost of an idle prefill (whole prompts, larger and cheaper matmuls)
  doubled gives the first budget, or START_TOKENS before even that.

The streams' gap while a long prompt prefills is then about STALL_FACTOR of their TPOT (target:
<= 4x), and the prompt's TTFT about 1 + 1 / (STALL_FACTOR - 1) of its TTFT alone (target: <=
1.6x), give or take what a chunk costs more than a whole prompt's token. A fixed
`--max-prefill-tokens N` turns all this off. A token count tuned on one CPU does not travel: 96
tokens kept the gap at 3.7x a TPOT on a Xeon with AMX, and 10.4x on an EPYC with AVX2.
"""

from __future__ import annotations

STALL_FACTOR = 3.0
MIN_TOKENS = 16  # one prefix-cache block: a smaller chunk costs its per-step overhead for little
START_TOKENS = 96  # before the loop has timed a decode-only step and a prefill
SMOOTHING = 0.3  # weight of the newest measurement in each moving average
IDLE_PRIOR = 2.0  # a chunk beside decoding rows is taken to cost this many idle-prefill tokens until timed
MAX_GROWTH = 2.0  # the budget at most doubles from one prefilling step to the next


class PrefillBudget:
    def __init__(self, fixed: int | None, max_tokens: int) -> None:
        self.fixed = fixed
        self.max_tokens = max_tokens
        self._decode: dict[int, float] = {}  # decoding rows -> seconds of a decode-only step
        self._token_idle: float | None = None  # seconds per prompt token, nothing decoding
        self._fed: float | None = None  # the budget the feedback arrived at (None: not yet)

    def tokens(self, decoding: int) -> int:
        """The budget of a step with `decoding` rows decoding (> 0; an idle step has its own rule)."""
        if self.fixed is not None:
            return self.fixed
        if self._fed is not None:
            return self._clamp(self._fed)
        decode = self._decode_seconds(decoding)
        if decode is None or self._token_idle is None or self._token_idle <= 0:
            return START_TOKENS
        return self._clamp((STALL_FACTOR - 1) * decode / (self._token_idle * IDLE_PRIOR))

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
        if decode is None:
            return
        target = (STALL_FACTOR - 1) * decode
        excess = max(seconds - decode, target / MAX_GROWTH**2)  # a step within the decode time grows it 2x
        self._fed = self._clamp(prefill_tokens * (target / excess) ** 0.5)

    def _clamp(self, tokens: float) -> int:
        return max(MIN_TOKENS, min(self.max_tokens, int(tokens)))

    def _decode_seconds(self, decoding: int) -> float | None:
        """A decode-only step's time at `decoding` rows, or at the nearest row count timed."""
        if decoding in self._decode:
            return self._decode[decoding]
        if not self._decode:
            return None
        return self._decode[min(self._decode, key=lambda rows: (abs(rows - decoding), rows))]

    def describe(self) -> dict[str, object]:
        """The estimates, for logs."""
        return {"fixed": self.fixed, "fed": self._fed, "token_ms_idle": _ms(self._token_idle),
                "decode_ms": {rows: _ms(s) for rows, s in sorted(self._decode.items())}}


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
