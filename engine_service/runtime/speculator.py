"""Prompt-lookup speculation in the decode loop (`--speculative ngram`): each step, the decoding
rows' drafts (speculative.py's NgramIndex over each sequence's prompt and output), and after the
forward that verified them, each row's tokens (speculative.verify).

A step speculates only while at most `max_rows` rows decode (SPECULATIVE_MAX_ROWS): a verify step
feeds 1 + k tokens per row, which a large batch pays for in every row while few drafts are
accepted (llama.cpp measured its lookup decoding at 1.10x with one slot and 0.77x with eight), so
larger batches decode as without it, and cost nothing but the check. Rows with no match in their
text are fed their last token alone, as in a plain step.

A step that carries a prompt chunk decodes its greedy rows plainly: the prompts waiting behind
it would pay for their verify steps (`drafts`). Within that, a row count speculates while it
pays: the loop gives each verify step's time and tokens (`observe`) with a plain step's time at
as many rows (the prefill budget's), and where the moving payoff falls below 1 (verify steps gave
fewer tokens a second than plain steps would), that row count decodes plainly but for one step in
RETRY_EVERY, which measures again. Both gates hold only steps whose rows are all greedy: a greedy
row's tokens do not depend on whether a step verifies (beyond the rounding a row count picks with
quantized copies, as batching's), a seeded sampled row's do (its generator's draws), and must not
on the machine's speed or on other requests' arrivals. Measured on the
Xeon 207 with AMX: a verify step of 2-4 rows cost 1.7-4.2x a plain step of as many rows
(docs/decode-speed.md), more than chance drafts on unrelated text repay; one row of 7 tokens,
traced, about 2x, which a grounded draft repays several times over.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine_service.generation.speculative import SpeculativeConfig
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import DecodeRow

SPECULATIVE_MAX_ROWS = 4
PAYOFF_SMOOTHING = 0.3  # weight of the newest verify step in a row count's moving payoff
RETRY_EVERY = 16  # at a row count whose verify steps did not pay, one step in this many verifies again


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_rows: int = SPECULATIVE_MAX_ROWS) -> None:
        self.config = config
        self.max_rows = max_rows
        self._payoff: dict[int, float] = {}  # rows -> a verify step's tokens a second over a plain step's
        self._skipped: dict[int, int] = {}  # rows -> steps not speculated since the last try
        self._unmeasured: set[int] = set()  # row counts whose next greedy step runs plainly, to be timed

    def drafts(self, decoding: Seq[Sequence], prefilling: bool = False) -> list[list[int]] | None:
        """One draft per decoding row (possibly empty), or None for a plain step: too many rows,
        or no row has a draft, or a row's logits are processed before sampling (logit bias,
        penalties, min_new_tokens, a response_format: verification knows the plain distribution
        only), or every row is greedy and either the step carries a prompt chunk (`prefilling`)
        or this row count's verify steps have not paid (`_pays`). A draft never runs past the
        row's max_new_tokens."""
        if not decoding or len(decoding) > self.max_rows or not all(s.controls.plain for s in decoding):
            return None
        # a gate of measured times, or of other requests' arrivals, would make a seeded sampled
        # row's tokens depend on the machine's speed (whether a step verifies decides which draws
        # its generator makes): greedy steps only. Beside a prompt chunk a verify step runs eagerly,
        # each row a masked chunk, where the plain step is the traced mixed one, and every prompt
        # waiting to start pays for it: 2 rows and a 16-token chunk took 53-66 ms verifying against
        # 40-42 plain, and 32 requests at once gave 0.84x the tok/s of the plain engine (Xeon 207)
        if all(s.request.sampling.greedy for s in decoding) and (prefilling or not self._pays(len(decoding))):
            return None
        drafts = [seq.controls.draft(self.config, seq.generated) for seq in decoding]
        return drafts if any(drafts) else None

    def _pays(self, rows: int) -> bool:
        """Whether a step of `rows` rows speculates: unless its verify steps have measured slower
        than plain steps (payoff below 1), then once in RETRY_EVERY such steps, to measure again;
        and not once after a verify step found no plain step of as many rows timed (`observe`)."""
        if rows in self._unmeasured:
            self._unmeasured.discard(rows)
            return False
        payoff = self._payoff.get(rows)
        if payoff is None or payoff >= 1.0:
            return True
        self._skipped[rows] = self._skipped.get(rows, 0) + 1
        if self._skipped[rows] < RETRY_EVERY:
            return False
        self._skipped[rows] = 0
        return True

    def observe(self, rows: int, tokens: int, seconds: float, plain_seconds: float | None) -> None:
        """A verify step of `rows` rows and no prompt chunk gave `tokens` tokens in `seconds`, where
        a plain step of as many rows takes `plain_seconds` (None: none timed yet, no comparison).
        Its payoff is its tokens a second over the plain step's, `rows` a step. With none timed, the
        next greedy step of as many rows runs plainly, so that one is: where every step of a row
        count verified, none was ever timed, and its verify steps went on unweighed (on an AMD EPYC
        of the Zen 4 class, 2-4 rows verifying at the end of 32 requests at once took 24-70 ms a
        step against 8-12 ms plain, for 1.5-3 tokens a row)."""
        if plain_seconds is None:
            self._unmeasured.add(rows)
            return
        payoff = tokens * plain_seconds / (rows * seconds)
        old = self._payoff.get(rows)
        self._payoff[rows] = payoff if old is None else old + PAYOFF_SMOOTHING * (payoff - old)

    def describe(self) -> dict[int, float]:
        """The payoff measured at each row count, for logs."""
        return {rows: round(p, 3) for rows, p in sorted(self._payoff.items())}

    @staticmethod
    def choose(logits: torch.Tensor, decodes: Seq[DecodeRow]) -> list[list[int]]:
        """The tokens of each decode row, by verifying its draft against its rows of `logits`
        (the rows after them, the completing prefills', are the loop's to sample)."""
        return [d.seq.controls.verify(d.draft, logits[d.logits]) for d in decodes]
