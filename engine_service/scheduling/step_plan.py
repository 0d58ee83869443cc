"""One step's layout: every scheduled sequence's KV row and its rows of the step's logits.

The scheduler builds one `StepPlan` a step (Scheduler.plan); the decode loop, the model runner and
the speculator read rows only from it. The layout (kv_cache.py keeps the rows; this is the rule):

- the decode rows are KV rows 0..d-1, in order: `model.decode` and the traced decode read them as
  one batch by position, so a decode row's KV row is its index among them;
- the prompt chunks of prefilling sequences sit in KV rows d..n-1, each row at most once;
- the logits the step samples from (`StepLogits.sampled`) are, in order: each decode row's 1 +
  len(draft) rows (one when it has no draft), then one row for each prompt chunk that completes
  its prompt (that row gives the sequence's first token). `logits` of each entry is its slice;
- a prompt chunk that runs through the layers over several steps (a layer-sliced prefill, its
  `sublayers` this step's span of them, whole sublayers and parts of their rows) is the step's
  only chunk, and completes its prompt only in the step that runs its last sublayer's last rows.

`StepPlan.build` checks all of it and raises `PlanError` (a bug: the decode loop's fatal path)
when any part does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

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
class SublayerSpan:
    """This step's part of a prompt chunk that runs through the layers over several steps, two
    sublayers to a decoder layer (2i its attention, 2i + 1 its MLP): from sublayer `first` at the
    chunk's row `first_row` up to sublayer `stop` at row `stop_row`, that is, sublayer first's rows
    from first_row on, the sublayers between whole, and sublayer stop's rows before stop_row (none
    where it is 0). A sublayer's rows run in order, so the rows before a part have their keys and
    values cached for it (a part of an attention is a prompt chunk of its own, from its first row).
    `last`: stop is the model's count of sublayers, so the chunk is done after this step."""

    first: int
    stop: int
    last: bool
    first_row: int = 0
    stop_row: int = 0

    @property
    def resume(self) -> tuple[int, int]:
        """Where the chunk's next span starts: (stop, stop_row)."""
        return self.stop, self.stop_row

    def pieces(self, rows: int) -> list[tuple[range, int, int]]:
        """The span over a chunk of `rows` rows as (sublayers, first row, stop row): whole
        sublayers in runs over rows 0..rows-1, and each part sublayer's rows alone."""
        out: list[tuple[range, int, int]] = []
        sub, row = self.first, self.first_row
        while (sub, row) < (self.stop, self.stop_row):
            end = self.stop_row if sub == self.stop else rows
            if out and row == 0 and end == rows and out[-1][1:] == (0, rows):
                out[-1] = (range(out[-1][0].start, sub + 1), 0, rows)
            else:
                out.append((range(sub, sub + 1), row, end))
            sub, row = sub + 1, 0
        return out


Sliced = tuple[Sequence, PromptChunk, SublayerSpan]  # a layer-sliced chunk's sequence, chunk and span this step


@dataclass(frozen=True)
class Prefill:
    """A chunk of a prefilling sequence's prompt this step, in KV row `chunk.row`, through every
    layer, or through `sublayers` only (a layer-sliced prefill); when the chunk is done this step and
    ends the prompt, `logits` is its one row of logits (the first token's), else None."""

    seq: Sequence
    chunk: PromptChunk
    logits: slice | None = None
    sublayers: SublayerSpan | None = None

    @property
    def done(self) -> bool:
        """The chunk has run through every layer after this step: its keys and values are cached."""
        return self.sublayers is None or self.sublayers.last

    @property
    def completes(self) -> bool:
        """The chunk is done and ends the prompt, so this step samples the sequence's first token."""
        return self.done and self.chunk.start + self.chunk.length == len(self.seq.request.prompt_ids)

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
              drafts: Seq[Seq[int]] | None = None,
              sliced: Sliced | None = None) -> StepPlan:
        """The plan of a step that decodes `decoding` (KV rows 0..d-1, in order) with `drafts` (one
        per decoding sequence, or None for a plain step) and prefills `chunks`, or the `sliced`
        chunk through its span of sublayers; the logits slices follow the layout above. Raises
        PlanError when the rows or chunks break it."""
        if drafts is not None and len(drafts) != len(decoding):
            raise PlanError(f"step plan: {len(drafts)} drafts for {len(decoding)} decode rows")
        decodes, at = [], 0
        for row, seq in enumerate(decoding):
            draft = tuple(drafts[row]) if drafts is not None else ()
            decodes.append(DecodeRow(seq, row, slice(at, at + 1 + len(draft)), draft))
            at += 1 + len(draft)
        prefills = []
        entries = [*((seq, chunk, None) for seq, chunk in chunks), *((sliced,) if sliced is not None else ())]
        for seq, chunk, span in entries:
            prefill = Prefill(seq, chunk, None, span)
            if prefill.completes:  # its one row of logits, the first token's
                prefill = replace(prefill, logits=slice(at, at + 1))
                at += 1
            prefills.append(prefill)
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
        for p in self.prefills:
            span = p.sublayers
            if span is None:
                continue
            if len(self.prefills) > 1:
                problems.append(f"{p.seq.request_id}: a layer-sliced chunk beside {len(self.prefills) - 1} other chunks")
            if not (0 <= span.first and (span.first, span.first_row) < (span.stop, span.stop_row)
                    and 0 <= span.first_row < p.chunk.length and 0 <= span.stop_row < p.chunk.length
                    and not (span.last and span.stop_row)):
                problems.append(f"{p.seq.request_id}: sublayers from {span.first} row {span.first_row} "
                                f"to {span.stop} row {span.stop_row} of a {p.chunk.length}-token chunk")
            if p.seq.request.echo_prompt_logprobs:
                problems.append(f"{p.seq.request_id}: a layer-sliced chunk of a prompt whose log-probabilities are echoed")
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
    def sliced(self) -> Prefill | None:
        """The layer-sliced chunk of this step, if any (then the step's only chunk)."""
        return next((p for p in self.prefills if p.sublayers is not None), None)

    @property
    def prefill_tokens(self) -> int:
        return sum(p.chunk.length for p in self.prefills)
