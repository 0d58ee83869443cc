"""How many prompt tokens a step may prefill beside the decoding rows (`--max-prefill-tokens auto`,
the default), from two costs the decode loop measures as it runs, so that the budget travels
from one CPU to another: a token count tuned on one does not (96 tokens kept the streams' gap at
3.7x their TPOT on the Xeon with AMX it was tuned on, and at 10.4x on an EPYC with AVX2).

- a decode-only step's seconds, per number of decoding rows (moving average over plain steps);
- an idle prefill's seconds per prompt token (steps that prefill with nothing decoding: whole
  prompts, the cheapest tokens there are).

- what a prompt token prefilled beside d decoding rows costs in idle ones (the chunk cost:
  smaller matmuls, attention over the row's cached positions, and a step that prefills runs on
  the full weights (at 9-32 rows in all, the AMX int4 kernel where the CPU has it) rather than
  the int4 copies' kernel a decode-only step of up to 8 rows runs):
  each such step's time beyond a decode-only step of its rows, over its tokens' idle cost; a moving
  average per number of decoding rows (up to 8 rows a decode-only step runs on the int4 copies and
  a mixed one does not; above, both run on the full weights), from CHUNK_COST, held within
  MIN_CHUNK_COST..MAX_CHUNK_COST.

The budget beside d decoding rows is (STALL_FACTOR - 1) x decode step(d) / (chunk cost x idle
cost per token): a prefilling step is meant to take about STALL_FACTOR decode steps. On SmolLM2
with 8 rows decoding, one run: a 16-token chunk at position 100 took 51.5 ms, at 1,000 61 ms, at
1,900 94 ms, and 64 or 128 tokens at 1,000 took 112 ms, against 30 ms for the decode-only step; an
idle prefill of 2,000 tokens took 1.2-2.0 s.

The chunk cost was a constant, CHUNK_COST (1.35-2x measured where it was set), until a Xeon of
family 6 model 207 with AMX (2026-12-05): there a 2,000-token prompt prefills alone at 0.38-0.50 ms
a token (AMX runs its 2,000-row matmuls at 2.3 TFLOP/s and a 72-row one at 0.67), while a chunk's
token beside 8 decoding rows cost 0.9-1.0 ms (the engine's `prefill_step` log: steps of 72-114
tokens took 95-140 ms against a 30-ms decode step), 2.2-2.4 idle ones, so every mixed step ran over
its 3.5 decode steps and the streams' largest gap reached 5.1-5.5x their TPOT. A step's cost that
does not grow with its tokens (the eager step's operators, the switch from the int4 copies to the
full weights) is counted into the chunk cost too, which is what makes the steps land on their
target: with a fixed part F and the true cost c, the chunks settle at (target - F) / c tokens
(the estimate's fixed point, stable while F is below the target's chunk share; beyond it the
chunks shrink to their floor, MAX_CHUNK_COST bounding how far).

Both costs are ratios of the same machine's speed, so the budget holds still when the machine
slows down (other processes, a busy neighbour) instead of chasing it. A feedback on each
prefilling step's own time was tried: it held the gap (3.5-4.0x) but, where a step's fixed part
alone exceeded the target (late chunks of long prompts, or a contended CPU), it shrank the chunks
to the floor and prompts queued behind each other for tens of seconds (the demo's 448-token
prompts at concurrency 8: TTFTs up to 46 s). `--max-prefill-tokens N` fixes the budget.

Measured (benchmarks/chunked_prefill.py, Xeon with AMX, one run): the streams' largest gap 3.75x
their TPOT (bound 4x), the long prompt's TTFT 1.93x its TTFT alone (bound 1.6x: missed). Here the
two bounds meet only near 96 tokens, where four runs gave gaps of 3.49-4.38x and TTFTs of
1.23-1.76x: the gap is held first, since it is what every running stream feels.

A prompt token's cost grows with the positions it attends: its matmuls are fixed, its attention
reads every cached position before it. So both costs are counted in tokens at position 0, a token
at position p weighing 1 + p / parity, where `parity` (`attention_parity`, from the model's shapes)
is the position at which a token's attention takes as many FLOPs as its matmuls (SmolLM2: 3,072).
An idle prefill's cost per token divides by its tokens' weight, and a chunk at position p gets the
tokens whose weight fits: late chunks of a long prompt shrink, early ones grow. Measured, SmolLM2
in bfloat16 with int4 decode, 8 rows decoding, Xeon (AVX-512 BF16, no AMX), ms a mixed step with a
16/64-token chunk: 87/169 at position 0, 119/262 at 1,950: the cost per chunk token 1.71 and 2.98
ms, 1.74x, where the weights give 1.64x. Without it the budget held at its floor (32 tokens) to the
end and the streams' gap at 5.27x their TPOT on that Xeon.

The engine gives its budget a parity measured at start-up on a CPU (runtime/build.chunk_parity,
model/attention_cost.py: one layer's projections over a chunk's rows against its attention at
depth), held within 1/8 and 2x of the FLOPs' one: attention runs at a lower FLOP rate than the
matmuls (on the Xeon 207 with AMX, 245 GFLOP/s against 620; measured parity 1,150-1,800 positions
against 3,072 by FLOPs), and with the FLOPs' parity a long prompt's late chunks overran their target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import PromptChunk

STALL_FACTOR = 3.5
CHUNK_COST = 1.5  # a prompt token prefilled beside decoding rows: idle ones, before a mixed step is timed
MIN_CHUNK_COST, MAX_CHUNK_COST = 1.0, 4.0  # the learned chunk cost's bounds (one step's noise, a fixed part)
MIN_TOKENS = 16  # one prefix-cache block: a smaller chunk pays a step's fixed cost for little
START_TOKENS = 96  # before the loop has timed a decode-only step and an idle prefill
SMOOTHING = 0.3  # weight of the newest measurement in each moving average


def attention_parity(config: ModelConfig) -> float:
    """The cached positions at which a token's attention (QK and PV: 4 x heads x head_dim FLOPs a
    position) takes as many FLOPs as its matmuls (2 per weight of q/k/v, o, gate/up and down)."""
    hidden, heads, dim = config.hidden_size, config.num_attention_heads, config.dim_per_head
    weights = hidden * (heads + 2 * config.num_key_value_heads) * dim + heads * dim * hidden \
        + 3 * hidden * config.intermediate_size
    return 2 * weights / (4 * heads * dim)


class PrefillBudget:
    def __init__(self, fixed: int | None, max_tokens: int, parity: float = math.inf) -> None:
        """`parity`: attention_parity of the model served (inf: attention taken as free)."""
        self.fixed = fixed
        self.max_tokens = max_tokens
        self.parity = parity
        self._decode: dict[int, float] = {}  # decoding rows -> seconds of a decode-only step
        self._token_idle: float | None = None  # seconds per prompt token at position 0, nothing decoding
        self._chunk_cost: dict[int, float] = {}  # decoding rows -> a prompt token beside them, in idle ones

    def tokens(self, decoding: int, position: int) -> int:
        """The budget of a step with `decoding` rows decoding (> 0; an idle step has its own rule)
        whose first chunk starts at `position`."""
        if self.fixed is not None:
            return self.fixed
        decode = self._decode_seconds(decoding)
        if decode is None or self._token_idle is None or self._token_idle <= 0:
            return START_TOKENS
        chunk_cost = self._chunk_cost.get(decoding, CHUNK_COST)
        weight = (STALL_FACTOR - 1) * decode / (chunk_cost * self._token_idle)  # tokens at position 0
        return max(MIN_TOKENS, min(self.max_tokens, int(self._fitting(weight, position))))

    def _fitting(self, weight: float, position: int) -> float:
        """The tokens T from `position` on whose weights (as `weight` counts them) sum to `weight`:
        the root of T^2 / (2 parity) + T (1 + (position - 1/2) / parity) = weight, in a form that
        holds as parity grows without bound."""
        u = 1 + (position - 0.5) / self.parity
        return 2 * weight / (u + math.sqrt(u * u + 2 * weight / self.parity))

    def weight(self, chunks: Sequence[PromptChunk]) -> float:
        """The chunks' tokens counted at position 0: each weighs 1 + its position / parity (the
        mean of a chunk's positions, start + (length - 1) / 2, stands for its tokens')."""
        return sum(c.length * (1 + (c.start + (c.length - 1) / 2) / self.parity) for c in chunks)

    def observe(self, decoding: int, chunks: Sequence[PromptChunk], seconds: float) -> None:
        """A plain step took `seconds` with `decoding` rows decoding and `chunks` of prompts prefilling."""
        if not chunks:
            if decoding:
                self._decode[decoding] = _average(self._decode.get(decoding), seconds)
        elif decoding == 0:
            self._token_idle = _average(self._token_idle, seconds / self.weight(chunks))
        else:
            decode = self._decode_seconds(decoding)
            if decode is None or self._token_idle is None or self._token_idle <= 0:
                return  # nothing yet to count this step's cost against
            cost = (seconds - decode) / (self.weight(chunks) * self._token_idle)
            self._chunk_cost[decoding] = _average(self._chunk_cost.get(decoding, CHUNK_COST),
                                                  min(MAX_CHUNK_COST, max(MIN_CHUNK_COST, cost)))

    def plain_seconds(self, decoding: int) -> float | None:
        """A decode-only step's time at exactly `decoding` rows, None until one is timed."""
        return self._decode.get(decoding)

    def _decode_seconds(self, decoding: int) -> float | None:
        """A decode-only step's time at `decoding` rows, or at the nearest row count timed."""
        if decoding in self._decode:
            return self._decode[decoding]
        if not self._decode:
            return None
        return self._decode[min(self._decode, key=lambda rows: (abs(rows - decoding), rows))]

    def describe(self) -> dict[str, object]:
        """The estimates, for logs."""
        return {"fixed": self.fixed, "parity": None if math.isinf(self.parity) else self.parity,
                "token_ms_idle": _ms(self._token_idle),
                "chunk_cost": {rows: round(c, 3) for rows, c in sorted(self._chunk_cost.items())},
                "decode_ms": {rows: _ms(s) for rows, s in sorted(self._decode.items())}}


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
