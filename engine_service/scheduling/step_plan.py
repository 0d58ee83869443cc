"""One step's layout: every scheduled sequence's KV row and its rows of the step's logits.

The scheduler builds one `StepPlan` a step (Scheduler.plan); the decode loop, the model runner and
the speculator read rows only from it. The layout (kv_cache.py keeps the rows; this is the rule):

- the decode rows are KV rows 0..d-1, in order: `model.decode` and the traced decode read them as
  one batch by position, so a decode row's KV row is its index among them;
- the prompt chunks of prefilling sequences sit in KV rows d..n-1, each row at most once;
- the logits the step samples from (`StepLogits.sampled`) are, in order: each decode row's 1 +
  len(draft) rows (one when it has no draft), then one row for each prompt chunk that completes
  its prompt (that row gives the sequence's first token). `logits` of each entry is its slice.

`StepPlan.build` checks all of it and raises `PlanError` (a bug: the decode loop's fatal path)
when any part does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine_service.model.kv_cache import PromptChunk
from engine_service.scheduling.sequence import Sequence


class PlanError(AssertionError):
    """A step plan that breaks the row layout: a defect in the scheduler, never a request's fault."""


@dataclass(frozen=True)
class DecodeRow:
    """A decoding sequence this step: fed its last token (and its draft, when speculating) in KV
    row `row`; its 1 + len(draft) rows of logits are `logits`."""

    seq: Sequence
    row: int
    logits: slice
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class Prefill:
    """A chunk of a prefilling sequence's prompt this step, in KV row `chunk.row`; when it ends the
    prompt, `logits` is its one row of logits (the first token's), else None."""

    seq: Sequence
    chunk: PromptChunk
    logits: slice | None = None

    @property
    def completes(self) -> bool:
        """The chunk ends the prompt, so this step samples the sequence's first token."""
        return self.chunk.start + self.chunk.length == len(self.seq.request.prompt_ids)

    @property
    def row(self) -> int:
        return self.chunk.row


@dataclass(frozen=True)
class StepPlan:
    decodes: tuple[DecodeRow, ...]
    prefills: tuple[Prefill, ...]
    speculative: bool = False  # the decode rows are verified with their drafts (a verify step)

    @classmethod
    def build(cls, decoding: Seq[Sequence], chunks: Seq[tuple[Sequence, PromptChunk]],
              drafts: Seq[Seq[int]] | None = None) -> StepPlan:
        """The plan of a step that decodes `decoding` (KV rows 0..d-1, in order) with `drafts` (one
        per decoding sequence, or None for a plain step) and prefills `chunks`; the logits slices
        follow the layout above. Raises PlanError when the rows or chunks break it."""
        if drafts is not None and len(drafts) != len(decoding):
            raise PlanError(f"step plan: {len(drafts)} drafts for {len(decoding)} decode rows")
        decodes, at = [], 0
        for row, seq in enumerate(decoding):
            draft = tuple(drafts[row]) if drafts is not None else ()
            decodes.append(DecodeRow(seq, row, slice(at, at + 1 + len(draft)), draft))
            at += 1 + len(draft)
        prefills = []
        for seq, chunk in chunks:
            completes = chunk.start + chunk.length == len(seq.request.prompt_ids)
            prefills.append(Prefill(seq, chunk, slice(at, at + 1) if completes else None))
            at += completes
        plan = cls(tuple(decodes), tuple(prefills), speculative=drafts is not None)
        plan.check()
        return plan

    def check(self) -> None:
        """Raise PlanError unless the plan keeps the layout (module docstring)."""
        d = len(self.decodes)
        rows = [p.row for p in self.prefills]
        seqs = [e.seq for e in (*self.decodes, *self.prefills)]
        problems = []
        if [e.row for e in self.decodes] != list(range(d)):
            problems.append(f"decode rows {[e.row for e in self.decodes]} are not 0..{d - 1}")
        if len(set(rows)) != len(rows) or any(r < d for r in rows):
            problems.append(f"prefill rows {rows} repeat a row or overlap the {d} decode rows")
        if len({id(s) for s in seqs}) != len(seqs):
            problems.append("a sequence is scheduled twice")
        for p in self.prefills:
            c, prompt = p.chunk, len(p.seq.request.prompt_ids)
            if c.length < 1 or c.start < 0 or c.start + c.length > prompt:
                problems.append(f"{p.seq.request_id}: chunk [{c.start}, {c.start + c.length}) of a {prompt}-token prompt")
        at = 0
        for e in self.producing:
            if e.logits is None or e.logits.start != at or e.logits.stop <= at:
                problems.append(f"{e.seq.request_id}: logits {e.logits} where row {at} comes next")
                break
            at = e.logits.stop
        if any(p.logits is not None for p in self.prefills if not p.completes):
            problems.append("a chunk that does not end its prompt has logits")
        if problems:
            raise PlanError("step plan breaks the row layout: " + "; ".join(problems))

    @property
    def producing(self) -> tuple[DecodeRow | Prefill, ...]:
        """What produces tokens this step, in the order of its logits: every decode row, then each
        prompt chunk that completes its prompt."""
        return (*self.decodes, *(p for p in self.prefills if p.completes))

    @property
    def sampled_rows(self) -> int:
        """How many rows of logits the step samples from."""
        return sum(e.logits.stop - e.logits.start for e in self.producing if e.logits is not None)

    @property
    def prefill_tokens(self) -> int:
        return sum(p.chunk.length for p in self.prefills)
