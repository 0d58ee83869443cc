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

Layer-sliced prefill (`slice_tokens`, `slice_stop`; scheduler.Slicer). A prompt with more than
MIN_SLICE_TOKENS to go that would take more than one plain chunk beside decoding rows is not
chunked by tokens into mixed steps: it runs in large chunks, each through a span of the model's
sublayers a step (2i layer i's attention, 2i + 1 its MLP), after the decoding rows' own
decode-only step, until its last sublayer gives the first token. Why: a mixed step's fixed part,
F, about 1.7 decode steps on the Xeon 207 with AMX (the full weights' pass at 16-72 rows, or the
AMX int4 kernel's widening), leaves a chunk (S - F) of a step of S decode steps, and the prompt
waits S / (S - F) times its work: 2-2.7x its TTFT alone there (bound 1.6x), while the steps still
overran (the streams' gap 4.5-4.6x, bound 4x). A sliced step pays one decode step (the decoding
rows' fast path) and the chunk's sublayers at about an idle prefill's cost a token (2,000 or 512
rows: the matmuls at their full rate), so the prompt waits S / (S - 1) times its work; with
SLICE_STALL_FACTOR 3 that is 1.5x at a full share.
- the step's target S, the stall factor (`_stall_factor`): SLICE_STALL_FACTOR decode steps until
  SPREAD_MIN sliced steps are timed, then as large as keeps the slowest recent ones within
  SLICE_GAP_BOUND decode steps: of the last SPREAD_WINDOW, the SPREAD_RANK-th slowest over the
  target it was sized for, in their decoding parts' median; held within SLICE_STALL_FACTOR and
  MAX_SLICE_STALL_FACTOR. The streams' largest gap is the slowest step, and how far the slowest
  runs past its target is the machine's: on the AMD EPYC of the Zen 4 class the second slowest of
  128 ran 1.04-1.13x its target in one phase and 1.2-1.43x in another (its decoding part and its
  sublayers slow together, for 0.3 s at a time). A fixed 3 held the gap there in the noisy phases,
  and left the TTFT at 1.7x in the still ones, where 3.4 gave 1.59x with the gap at 3.91x (`none`,
  one run); the factor now rises where the steps run still and stays at 3 where they do not;
- the step's share: (S - 1) decode steps' worth of sublayers, at the rate the
  sliced steps have shown (a moving average of their time beyond their decode step, a unit of
  their sublayers' weight, against that decode step's time: `observe_slice`, `_weight_seconds`;
  before one is timed, an idle prefill's rate). The decode step is the step's own decoding part
  where the runner timed it (on a CPU), else a decode-only step's estimate, which no step updates
  while a prompt is sliced (until later on 2026-12-06, always the estimate: 15.1-19.5 ms while
  the parts took 14.7 at the median);
- a sublayer's weight: an attention's tokens weigh attention_share of a layer's matmuls plus its
  attention at their positions (1 / parity a position), an MLP's the rest of the matmuls;
- a step's span: the sublayers that fit the share whole, then as many whole SLICE_BUCKETs of the
  next one's rows as fit what is left (at least one bucket a step), so that a step fills its
  share however large a sublayer is (`slice_stop`; step_plan.SublayerSpan). A sublayer's rows run
  in order, each part of an attention as a prompt chunk of its own over the row's cached keys
  (under a mask, or from 640 rows in two merged parts: llama.attend_after_prefix); buckets, because
  the runner has oneDNN make those row counts' kernels at start-up (a new count cost 30-45 ms
  inside a step on the Xeon 207 with AMX), and pads a chunk to whole buckets where it measured a
  new count that dear (ModelRunner.warm_sliced_prefill; on the Zen 4 EPYC 2.2 ms, so unpadded).
  Before (until 2026-12-06), a step held whole sublayers only, and a chunk was as large as kept its heavier sublayer within the share: on an
  AMD EPYC of the Zen 4 class a sublayer of its 1,280-1,408-token chunks took 14-38 ms against a
  share of 35 ms, so every step held one sublayer, filling 40-100% of its share, or passed it (the
  late chunk's attentions, 3.2-3.4 decode steps);
- a chunk's tokens: the whole prompt, up to MAX_SLICE_TOKENS, and all the rest where no more than
  MIN_SLICE_TOKENS would be left: a later chunk's attention reads the earlier ones' keys under a
  mask (no causal skip) and smaller chunks run their matmuls slower a token. Measured in one
  process (SmolLM2, int4 decode, bfloat16 prefill, a decode step of 8 rows before each span of 4
  sublayers, Xeon 207 with AMX, medians of 5): a 2,048-token chunk 753 ms, chunks of 1,152 and
  896 tokens 954 ms, an idle prefill of 2,000 tokens 688 ms; the torch profiler without the
  decode steps: attention 361 against 435 ms, linears 267 against 343 ms;
- the step that completes the prompt also runs the LM head, copies the prompt's blocks into the
  prefix cache (10-23 ms for 2,000 tokens) and samples the first token: that step's time beyond its
  sublayers is learned as the completion (decode steps a prompt token, `observe_slice`), not as
  the sublayers' rate, and its span leaves room for it (`slice_stop`). Before, the completing step
  was the largest of two prompts in four, 3.47 and 3.57 decode steps against 2.4-3.0 (the streams'
  largest gap), and its time taught the next prompt's first spans a rate too high (1 sublayer a
  step where 2 fit);
- no slicing with a fixed budget (`--max-prefill-tokens N` chunks by N tokens), with no decoding
  row (nobody waits: the whole prompt runs at once), for a prompt whose log-probabilities are
  echoed, or before a decode-only step and an idle prefill have been timed.
Measured with benchmarks/chunked_prefill.py (Xeon 207 with AMX, 4 rounds a run, medians), before
spans could end inside a sublayer, runs of that form and of the one before it (chunks sized for 4
sublayers) in turn: with `--quantize auto`
the streams' largest gap 3.76x and 3.81x their TPOT (before: 3.77x, 3.90x; plain chunks 4.5-4.6x),
the long prompt's TTFT 1.82x and 1.78x alone (before: 2.07x, 2.06x; plain chunks 2.2-2.7x); with
`--quantize none` gap 4.06x and 3.32x (3.52x, 3.20x), TTFT 1.60x and 1.75x (1.86x, 1.80x). The
4.06x is one round's 7.31x, a 166 ms gap in a round whose sliced steps took at most 67 ms.
Why the TTFT was still over 1.6x then: a step held whole sublayers, 26 ms a layer of a 2,000-token
chunk against a share of 28-50 ms, so steps ran 2.4-2.8 decode steps where 3 are allowed; and the
sliced work cost 1.05-1.2x an idle prefill's beside streaming rows. With spans ending inside a
sublayer (AMD EPYC of the Zen 4 class, 2026-12-06) the steps run 2.83-2.90 decode steps, and the
sliced work's 1.15-1.2x is what keeps the TTFT at 1.65-1.96x. Since (the same machine, later that
day): the merged attention from 640 rows with a KV head's queries folded into one call, the
chunk unpadded there, and the chunk counted against its step's own decoding part. A prompt's
time with the streams, per round: its steps' decoding parts 0.58-0.62 of its TTFT alone, its
sliced work 1.08-1.17 (in one process without the server, 1.08-1.14: the parts' attention and
matmuls over fewer rows), the time between steps 0.04-0.09; the TTFT 1.74-1.83x alone. A step's
time moves by half at the extremes (the median 44 ms, the slowest of 90 65-81 ms: an idle decode
step of 8 rows alone, 600 times, 12.1 ms at the median and 18.9 at the most), so the streams'
largest gap, the slowest step, stays at 3.5-4.4x their TPOT with steps of 2.9 decode steps, and
larger steps (which would bring the TTFT under 1.6x only with the sliced work at an idle
prefill's cost) would pass 4x. docs/decode-speed.md, "Layer-sliced prefill", "The Zen 4 class,
re-measured" and "The Zen 4 class, a second session", have the steps' logs and the forms tried.

The engine gives its budget a parity measured at start-up on a CPU (runtime/build.chunk_parity,
model/attention_cost.py: one layer's projections over a chunk's rows against its attention at
depth), held within 1/8 and 2x of the FLOPs' one: attention runs at a lower FLOP rate than the
matmuls (on the Xeon 207 with AMX, 245 GFLOP/s against 620; measured parity 1,150-1,800 positions
against 3,072 by FLOPs), and with the FLOPs' parity a long prompt's late chunks overran their target.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence

from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import PromptChunk
from engine_service.scheduling.step_plan import SublayerSpan

STALL_FACTOR = 3.5
CHUNK_COST = 1.5  # a prompt token prefilled beside decoding rows: idle ones, before a mixed step is timed
MIN_CHUNK_COST, MAX_CHUNK_COST = 1.0, 4.0  # the learned chunk cost's bounds (one step's noise, a fixed part)
MIN_TOKENS = 16  # one prefix-cache block: a smaller chunk pays a step's fixed cost for little
START_TOKENS = 96  # before the loop has timed a decode-only step and an idle prefill
SMOOTHING = 0.3  # weight of the newest measurement in each moving average
SLICE_STALL_FACTOR = 3.0  # a layer-sliced step's target, in decode steps, before and at least (module docstring)
MAX_SLICE_STALL_FACTOR = 4.0  # ... and at most, however still the steps run
SLICE_GAP_BOUND = 3.6  # the slowest sliced steps aimed at, in decode steps (the streams' bound: 4 of their TPOT)
SPREAD_WINDOW = 128  # the last sliced steps whose spread sizes the target (about one long prompt's)
SPREAD_MIN = 32  # ... once this many are timed
SPREAD_RANK = 2  # which of the window's slowest steps stands for them: the second (one stray step is left out)
SLICE_BUCKET = 128  # a sliced chunk's tokens: a whole number of these, or the prompt's rest (the runner pads it)
MIN_SLICE_TOKENS = 512  # a prompt with no more to go prefills in plain chunks, and no sliced chunk is smaller
MAX_SLICE_TOKENS = 4096  # no sliced chunk is larger but by a joined rest (the runner warms its row counts up to there)
SLICE_COST = 1.0  # a sliced step's sublayers, in idle prefill's cost of them, before one is timed
MAX_COMPLETION = 0.01  # a sliced prompt's completion, in decode steps a prompt token: its learned value's bound
MIN_SLICE_COST, MAX_SLICE_COST = 0.25, 4.0  # its learned value's bounds (idle prefills of short prompts cost more)


def attention_share(config: ModelConfig) -> float:
    """The attention projections' share of a layer's matmul weights: q/k/v and o against those and
    gate/up/down (SmolLM2: 0.25)."""
    hidden, heads, dim = config.hidden_size, config.num_attention_heads, config.dim_per_head
    attention = hidden * (heads + 2 * config.num_key_value_heads) * dim + heads * dim * hidden
    return attention / (attention + 3 * hidden * config.intermediate_size)


def attention_parity(config: ModelConfig) -> float:
    """The cached positions at which a token's attention (QK and PV: 4 x heads x head_dim FLOPs a
    position) takes as many FLOPs as its matmuls (2 per weight of q/k/v, o, gate/up and down)."""
    hidden, heads, dim = config.hidden_size, config.num_attention_heads, config.dim_per_head
    weights = hidden * (heads + 2 * config.num_key_value_heads) * dim + heads * dim * hidden \
        + 3 * hidden * config.intermediate_size
    return 2 * weights / (4 * heads * dim)


class PrefillBudget:
    def __init__(self, fixed: int | None, max_tokens: int, parity: float = math.inf, sublayers: int = 0,
                 attention_share: float = 0.5) -> None:
        """`parity`: attention_parity of the model served (inf: attention taken as free); `sublayers`:
        its count of them (2 a layer), where long prompts are layer-sliced beside decoding rows (0:
        never), and `attention_share` (attention_share) what of a layer's matmuls the first has."""
        self.fixed = fixed
        self.max_tokens = max_tokens
        self.parity = parity
        self.sublayers = sublayers if fixed is None else 0  # a fixed budget is a fixed chunk size: no slicing
        self.attention_share = attention_share
        # a sliced step's sublayers: seconds a unit of their weight, over a decode-only step's seconds
        # beside the rows it was learned beside (observe_slice), and those rows; None until one is timed
        self._slice_rate: tuple[float, int] | None = None
        self._slice_cost = SLICE_COST  # the same in idle prefill's cost of them, as of the last one (for logs)
        # what the step that completes a sliced prompt takes beyond its sublayers (the LM head, the
        # prefix cache's copy of the prompt's blocks, the first token), in decode steps a prompt token
        self._completion: float | None = None  # None until a completing step is timed: none counted
        self._decode: dict[int, float] = {}  # decoding rows -> seconds of a decode-only step
        self._token_idle: float | None = None  # seconds per prompt token at position 0, nothing decoding
        self._chunk_cost: dict[int, float] = {}  # decoding rows -> a prompt token beside them, in idle ones
        # the last sliced steps, each (its seconds over the stall factor it was sized for, its decoding
        # part's seconds), and the stall factor they set (_stall_factor)
        self._spread: deque[tuple[float, float]] = deque(maxlen=SPREAD_WINDOW)
        self._factor = SLICE_STALL_FACTOR

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

    def slice_tokens(self, decoding: int, position: int, remaining: int) -> int | None:
        """The tokens of a layer-sliced chunk from `position` (scheduler.Slicer), where the prompt
        would take more than one plain chunk beside `decoding` rows (> 0) and has more than
        MIN_SLICE_TOKENS to go (else None: plain chunks): all of them, up to MAX_SLICE_TOKENS in
        whole SLICE_BUCKETs, or all where the rest would be no more than MIN_SLICE_TOKENS, too few to
        slice. The larger the chunk, the nearer its cost a token to an idle prefill's (no later
        chunk's attention over the earlier ones' keys, no small matmuls); a step runs as many of its
        rows as its share holds (slice_stop)."""
        share = self._slice_share(decoding)
        if share is None or remaining <= max(MIN_SLICE_TOKENS, self.tokens(decoding, position)):
            return None
        tokens = min(remaining, MAX_SLICE_TOKENS)
        return remaining if remaining - tokens <= MIN_SLICE_TOKENS else tokens

    def slice_stop(self, decoding: int, chunk: PromptChunk, first: int, first_row: int = 0) -> tuple[int, int]:
        """Where this step's span of `chunk` from sublayer `first` at row `first_row` stops
        (scheduler.Slicer): (sublayer, row), as far as fills the step's share beside `decoding`
        rows, whole sublayers and then the whole SLICE_BUCKETs of rows of the next that fit, at
        least one bucket; the span that completes the prompt leaves room for its completion. All
        that is left where no row decodes (no stream waits) or nothing is measured yet."""
        share = self._slice_share(decoding)
        if share is None:
            return self.sublayers, 0
        completion = 0.0 if self._completion is None else self._completion_weight(decoding, chunk, self._completion)
        sub, row, used = first, first_row, 0.0
        while sub < self.sublayers:
            rest = self._sublayer_weight(chunk.start + row, chunk.length - row, sub)
            if used + rest + (completion if sub == self.sublayers - 1 else 0.0) <= share:
                sub, row, used = sub + 1, 0, used + rest
                continue
            # the whole buckets of this sublayer's rows that fit what is left, short of its last row
            more = range(1, -(-(chunk.length - row) // SLICE_BUCKET))
            fit = bisect.bisect_right(more, share - used, key=lambda n: self._sublayer_weight(
                chunk.start + row, n * SLICE_BUCKET, sub))
            if fit == 0 and (sub, row) == (first, first_row):  # at least one bucket
                return (sub, row + SLICE_BUCKET) if len(more) else (sub + 1, 0)
            return sub, row + fit * SLICE_BUCKET
        return sub, 0

    def _completion_weight(self, decoding: int, chunk: PromptChunk, completion: float) -> float:
        """The completion (`completion` decode steps a prompt token) of a prompt whose last chunk is
        `chunk`, beside `decoding` rows, in the share's units (idle prefill's tokens at position 0
        through every layer)."""
        basis = self._slice_basis(decoding)
        assert basis is not None  # a share was found, so was its basis
        decode, token_idle = basis
        return completion * (chunk.start + chunk.length) * decode / self._weight_seconds(token_idle)

    def _sublayer_weight(self, start: int, length: int, sublayer: int) -> float:
        """A chunk of `length` tokens from `start` through one sublayer, in idle prefill's tokens at
        position 0 through every layer: an attention (even) has attention_share of a layer's
        matmuls and the attention over the chunk's positions, an MLP (odd) the rest of the matmuls."""
        if sublayer % 2:
            per_token = 1 - self.attention_share
        else:
            per_token = self.attention_share + (start + (length - 1) / 2) / self.parity
        return length * per_token / (self.sublayers / 2)

    def _slice_share(self, decoding: int) -> float | None:
        """A step's share for a sliced chunk beside `decoding` rows, in idle prefill's tokens at
        position 0 through every layer: what (stall factor - 1) decode steps buy (`_stall_factor`);
        None where no slicing happens (`_slice_basis`)."""
        basis = self._slice_basis(decoding)
        if basis is None:
            return None
        decode, token_idle = basis
        return (self._factor - 1) * decode / self._weight_seconds(token_idle)

    def _stall_factor(self) -> float:
        """A sliced step's target in decode steps: SLICE_STALL_FACTOR until SPREAD_MIN steps are
        timed, then as large as keeps the slowest of the last SPREAD_WINDOW (their SPREAD_RANK-th
        slowest, each over the target it was sized for) within SLICE_GAP_BOUND of their decoding
        parts' median, held within SLICE_STALL_FACTOR..MAX_SLICE_STALL_FACTOR."""
        if len(self._spread) < SPREAD_MIN:
            return SLICE_STALL_FACTOR
        slowest = sorted(scaled for scaled, _ in self._spread)[-SPREAD_RANK]
        unit = statistics.median(decode for _, decode in self._spread)
        return min(MAX_SLICE_STALL_FACTOR, max(SLICE_STALL_FACTOR, SLICE_GAP_BOUND * unit / slowest))

    def _weight_seconds(self, token_idle: float) -> float:
        """A sliced step's sublayers: seconds a unit of their weight now. Learned (observe_slice) as
        a fraction of the decode-only step they rode beside, so counted against that step's time as
        it is now; SLICE_COST's idle prefill cost before a sliced step is timed. Not learned against
        an idle prefill's time: when the machine slows or speeds up as a whole (this class of VM
        moves 1.5-2x within minutes), the decode steps between prompts show it at once, where an
        idle prefill's time, measured rarely, goes stale, and a share sized from it overran: the
        first spans of a prompt in a slower phase took 4.8-5.1 decode steps against the 3 aimed at
        (Xeon 207 with AMX)."""
        if self._slice_rate is None:
            return SLICE_COST * token_idle
        rate, rows = self._slice_rate
        decode = self._decode_seconds(rows)
        assert decode is not None  # a rate is learned only against a decode step timed
        return rate * decode

    def _slice_basis(self, decoding: int) -> tuple[float, float] | None:
        """(a decode-only step's seconds beside `decoding` rows, an idle prompt token's), what a
        sliced step is sized and counted against; None where no slicing happens: no sublayers, no
        row decoding, or nothing measured yet."""
        decode, token_idle = self._decode_seconds(decoding), self._token_idle
        if not self.sublayers or not decoding or decode is None or token_idle is None or token_idle <= 0:
            return None
        return decode, token_idle

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

    def observe_slice(self, decoding: int, chunk: PromptChunk, span: SublayerSpan, seconds: float,
                      decode_seconds: float | None = None) -> None:
        """A step took `seconds` with `decoding` rows decoding and `chunk` through `span`: its time
        over the stall factor it was sized for, and its decoding part, join the spread that sets
        the factor (`_stall_factor`; steps beside other row counts share one window, which only
        holds the factor nearer 3: a slower row count's steps look slow against a faster one's
        median); the sliced chunk's time beyond the decode step's, a unit of the span's weight,
        over the decode step's (`_weight_seconds`' moving average), held within MIN_SLICE_COST and
        MAX_SLICE_COST times an idle prefill's. The decode step's time is its part of this step where the runner
        timed it (`decode_seconds`), else a decode-only step's estimate: no decode-only step runs
        while a prompt is sliced, so the estimate is as old as the prompt, and the machine's speed
        moves within it (one round on an AMD EPYC of the Zen 4 class: an estimate of 19.6 ms where the
        streams' steps before the prompt took 17.3 ms at the median, and their largest gap 4.34x
        that)."""
        basis = self._slice_basis(decoding)
        if basis is None:
            return  # another slicer's chunk (a test's), or nothing to count this step's cost against
        estimate, token_idle = basis
        decode = estimate if decode_seconds is None else decode_seconds
        self._spread.append((seconds / self._factor, decode))
        self._factor = self._stall_factor()
        weight = sum(self._sublayer_weight(chunk.start + first, stop - first, sub)
                     for sublayers, first, stop in span.pieces(chunk.length) for sub in sublayers)
        rate = self._weight_seconds(token_idle) / estimate  # a unit of weight's seconds, over a decode step's
        if span.last:  # the completing step: its time beyond the sublayers is the completion's
            beyond = (seconds - decode - weight * rate * decode) / decode
            completion = min(MAX_COMPLETION, max(0.0, beyond / (chunk.start + chunk.length)))
            self._completion = _average(self._completion, completion)
            return
        idle = token_idle / estimate  # an idle prefill's rate
        learned = _average(rate, min(MAX_SLICE_COST * idle, max(MIN_SLICE_COST * idle,
                                                                (seconds - decode) / (weight * decode))))
        self._slice_rate = (learned, decoding)
        self._slice_cost = learned / idle

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
                **({"slice_cost": round(self._slice_cost, 3), "slice_factor": round(self._factor, 3),
                    "completion_per_1k": None if self._completion is None else round(self._completion * 1000, 3)}
                   if self.sublayers else {}),
                "token_ms_idle": _ms(self._token_idle),
                "chunk_cost": {rows: round(c, 3) for rows, c in sorted(self._chunk_cost.items())},
                "decode_ms": {rows: _ms(s) for rows, s in sorted(self._decode.items())}}


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
