"""Prompt-lookup speculation in the decode loop (`--speculative ngram`): each step, the decoding
rows' drafts (speculative.py's NgramIndex over each sequence's prompt and output), and after the
forward that verified them, each row's tokens (speculative.verify).

A step speculates only while at most `max_rows` rows decode (SPECULATIVE_MAX_ROWS): a verify step
feeds 1 + k tokens per row, which a large batch pays for in every row while few drafts are
accepted (llama.cpp measured its lookup decoding at 1.10x with one slot and 0.77x with eight), so
larger batches decode as without it, and cost nothing but the check. Rows with no match in their
text are fed their last token alone, as in a plain step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine_service.generation.speculative import SpeculativeConfig
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import DecodeRow

SPECULATIVE_MAX_ROWS = 4


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_rows: int = SPECULATIVE_MAX_ROWS) -> None:
        self.config = config
        self.max_rows = max_rows

    def drafts(self, decoding: Seq[Sequence]) -> list[list[int]] | None:
        """One draft per decoding row (possibly empty), or None for a plain step: too many rows,
        or no row has a draft, or a row's logits are processed before sampling (logit bias,
        penalties, min_new_tokens, a response_format: verification knows the plain distribution
        only). A draft never runs past the row's max_new_tokens."""
        if not decoding or len(decoding) > self.max_rows or not all(s.controls.plain for s in decoding):
            return None
        drafts = [seq.controls.draft(self.config, seq.generated) for seq in decoding]
        return drafts if any(drafts) else None

    @staticmethod
    def choose(logits: torch.Tensor, decodes: Seq[DecodeRow]) -> list[list[int]]:
        """The tokens of each decode row, by verifying its draft against its rows of `logits`
        (the rows after them, the completing prefills', are the loop's to sample)."""
        return [d.seq.controls.verify(d.draft, logits[d.logits]) for d in decodes]
