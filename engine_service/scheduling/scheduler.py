"""Waiting and running sequences: admission, chunked prefill, the bounded queue, deadlines and
cancellation, and each step's plan.

The event loop thread calls `submit` and `wake`; the decode loop thread calls everything else.
Running sequences are kept packed in KV cache rows 0..n-1: rows 0..decoding-1 decode one token a
step (the traced decode reads them as one batch), and the rows after them are still prefilling
their prompts. The running list is this class's own; what a step computes, and in which rows, is
the `StepPlan` that `plan` builds (step_plan.py states the layout and checks it). Each step,
prompts are prefilled in chunks within the per-step prefill token budget, oldest admission first,
so a long prompt takes several steps and the decoding rows go on in every one of them; a prompt
whose last chunk ran has its first token and its row joins the decoding ones (`retire`). With a
`slicer`, a prompt that would take several chunks while rows decode runs instead as large chunks,
each through a span of the layers a step (a layer-sliced prefill: prefill_budget.py says why),
alone beside the decoding rows.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine_service.model.kv_cache import PromptChunk
from engine_service.scheduling.prefix_cache import PrefixCacheStats
from engine_service.scheduling.sequence import PromptSlice, Sequence
from engine_service.scheduling.step_plan import Sliced, StepPlan, SublayerSpan
from shared.errors import QueueFull

# A step with no decoding row prefills at least this many prompt tokens: a wave of 128-token
# prompts arriving together at an idle engine prefilled 1.5x faster in one step than in 96-token
# chunks, and no stream is waiting on it.
IDLE_PREFILL_TOKENS = 2048

MoveRow = Callable[[int, int, int], None]  # (src, dst, length): KVCache.move_row
SwapRows = Callable[[int, int, int, int], None]  # (a, b, length_a, length_b): KVCache.swap_rows
# the decoding rows' drafts, given whether the step carries a prompt chunk (runtime/speculator.py)
Drafts = Callable[[list[Sequence], bool], list[list[int]] | None]


class Slicer(Protocol):
    """Sizes layer-sliced prefills (PrefillBudget): `sublayers`, the model's count of them (2 a
    decoder layer: its attention, its MLP; 0: no slicing)."""

    sublayers: int

    def slice_tokens(self, decoding: int, position: int, remaining: int) -> int | None:
        """The tokens of a sliced chunk from `position` with `remaining` prompt tokens to go and
        `decoding` rows decoding, or None where the prompt prefills in plain chunks."""
        ...

    def slice_stop(self, decoding: int, chunk: PromptChunk, first: int, first_row: int = 0) -> tuple[int, int]:
        """Where this step's span of `chunk`'s sublayers from sublayer `first` at row `first_row`
        stops: (sublayer, row), after the start and at most (sublayers, 0) (step_plan.SublayerSpan)."""
        ...


@dataclass(frozen=True)
class LoadSnapshot:
    running_sequences: int = 0
    waiting_requests: int = 0
    kv_cache_used_tokens: int = 0
    kv_cache_capacity_tokens: int = 0
    requests_finished: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


class Scheduler:
    def __init__(self, max_batch: int, max_context: int, queue_capacity: int, queue_retry_seconds: float,
                 prefill_token_budget: int, slicer: Slicer | None = None) -> None:
        self.max_batch = max_batch
        self.slicer = slicer
        self.max_context = max_context
        self.queue_capacity = queue_capacity
        self.queue_retry_seconds = queue_retry_seconds
        self.prefill_token_budget = prefill_token_budget
        self._running: list[Sequence] = []  # KV row i holds _running[i]
        self._decoding = 0  # _running[:_decoding] decode; the rest are prefilling
        self._admissions = 0
        self._waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.finished_count = 0
        self.load = LoadSnapshot(kv_cache_capacity_tokens=max_batch * max_context)

    @property
    def rows(self) -> tuple[Sequence, ...]:
        """The running sequences by KV row (a copy: the rows are the plan's to give)."""
        return tuple(self._running)

    @property
    def decoding(self) -> int:
        """How many rows decode (rows 0..decoding-1)."""
        return self._decoding

    # -- event loop side -------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a parsed request, or raise QueueFull when the waiting queue is at capacity.
        Requests that free batch rows will take at the next step do not count against it."""
        with self._cond:
            depth = len(self._waiting)
            free_rows = max(self.max_batch - len(self._running), 0)  # a racy read is fine: off by a step
            if depth >= self.queue_capacity + free_rows:
                raise QueueFull.build(depth, self.queue_capacity, self.queue_retry_seconds)
            self._waiting.append(seq)
            self._cond.notify()

    def wake(self) -> None:
        """Make an idle decode loop look again (after a cancel, or to stop)."""
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    # -- decode loop side ------------------------------------------------------------------
    def wait_for_work(self) -> bool:
        """Block while nothing runs or waits. Returns False once stopped. (Queued deadlines need
        no timer: a queue is only non-empty while the loop is stepping.)"""
        with self._cond:
            while not self._stopped and not self._running and not self._waiting:
                self._cond.wait()
            return not self._stopped

    def take_dropped_waiting(self, now: float) -> list[Sequence]:
        """Remove queued sequences that were cancelled or whose deadline passed."""
        with self._cond:
            dropped = [s for s in self._waiting if s.cancelled or _expired(s, now)]
            for seq in dropped:
                self._waiting.remove(seq)
        self.finished_count += len(dropped)
        return dropped

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free rows, oldest first; they take the rows after every
        running one and prefill from the next `plan` on."""
        admitted: list[Sequence] = []
        with self._cond:
            while self._waiting and len(self._running) + len(admitted) < self.max_batch:
                seq = self._waiting.popleft()
                seq.admitted = self._admissions
                self._admissions += 1
                admitted.append(seq)
        self._running.extend(admitted)
        return admitted

    def plan(self, start: Callable[[Sequence, int], None], drafts: Drafts | None = None) -> StepPlan:
        """This step's plan: every decoding row, with its draft when `drafts` gives any (None: a
        plain step), and the prompt chunks of `_chunks`. `start(seq, row)` is called for a
        sequence about to prefill its first chunk (it may put a cached prefix into the row and
        advance `cache_len`)."""
        decoding = self._running[:self._decoding]
        chunks, sliced = self._chunks(start)
        prefilling = bool(chunks) or sliced is not None
        return StepPlan.build(decoding, chunks, drafts(decoding, prefilling) if drafts is not None else None, sliced)

    @property
    def prefill_position(self) -> int:
        """Where the next step's first chunk starts: the cached length of the prefilling row
        admitted first (0 when none prefills; a prompt not yet started may then skip a cached
        prefix)."""
        prefilling = self._running[self._decoding:]
        return min(prefilling, key=lambda seq: seq.admitted).cache_len if prefilling else 0

    def _chunks(self, start: Callable[[Sequence, int], None]) -> tuple[list[tuple[Sequence, PromptChunk]],
                                                                         Sliced | None]:
        """This step's prompt chunks: the prefilling rows in admission order, each given the rest of
        its prompt or what remains of the budget, until the budget is spent. The budget is the
        prefill token budget while any row decodes, else at least max_context and
        IDLE_PREFILL_TOKENS. Or, where the first row to prefill has a chunk in flight through the
        layers or the slicer slices its prompt, that chunk alone through its next span of sublayers."""
        # the budget bounds how long decoding rows wait for a step; with none, nobody waits, and
        # whole prompts (a wave of them, or one of any allowed length) go in one piece: larger
        # matmuls are faster per token
        budget = self.prefill_token_budget if self._decoding else max(self.prefill_token_budget, self.max_context,
                                                                      IDLE_PREFILL_TOKENS)
        chunks: list[tuple[Sequence, PromptChunk]] = []
        for row in sorted(range(self._decoding, len(self._running)), key=lambda r: self._running[r].admitted):
            if budget == 0:
                break
            seq = self._running[row]
            if seq.timings.prefill_started is None:
                start(seq, row)
            if not chunks and (sliced := self._sliced(seq, row)) is not None:
                return [], sliced
            length = min(len(seq.request.prompt_ids) - seq.cache_len, budget)
            chunks.append((seq, PromptChunk(row, seq.cache_len, length)))
            budget -= length
        return chunks, None

    def _sliced(self, seq: Sequence, row: int) -> Sliced | None:
        """`seq`'s chunk through its next span of sublayers: the chunk in flight, or a new one where
        the slicer slices its prompt (it is then in flight: seq.slice); None where neither."""
        slicer = self.slicer
        if slicer is None:
            return None
        if seq.slice is None:
            if seq.request.echo_prompt_logprobs:  # every token's logits come from a whole pass
                return None
            tokens = slicer.slice_tokens(self._decoding, seq.cache_len, len(seq.request.prompt_ids) - seq.cache_len)
            if tokens is None:
                return None
            seq.slice = PromptSlice(tokens)
        chunk, first, first_row = PromptChunk(row, seq.cache_len, seq.slice.length), seq.slice.sublayers_run, \
            seq.slice.rows_run
        stop, stop_row = slicer.slice_stop(self._decoding, chunk, first, first_row)
        return seq, chunk, SublayerSpan(first, stop, stop == slicer.sublayers, first_row, stop_row)

    def retire(self, plan: StepPlan, finished: list[Sequence], swap_rows: SwapRows, move_row: MoveRow) -> None:
        """After the step of `plan`: its prompts that completed join the decoding rows, then the
        `finished` sequences leave."""
        self.promote([p.seq for p in plan.prefills if p.completes], swap_rows)
        self.remove_rows([self._running.index(s) for s in finished], move_row)

    def drop(self, now: float, move_row: MoveRow) -> list[Sequence]:
        """Retire the running sequences that were cancelled or whose deadline passed; returns them."""
        return self.remove_rows(self.rows_to_drop(now), move_row)

    def promote(self, seqs: list[Sequence], swap_rows: SwapRows) -> None:
        """`seqs`, prefilling rows that have just produced their first token, join the decoding
        rows: each is swapped with the first prefilling row unless it is that row already."""
        for seq in seqs:
            row, first = self._running.index(seq), self._decoding
            if row != first:
                other = self._running[first]
                swap_rows(first, row, other.kv_len, seq.kv_len)
                self._running[first], self._running[row] = seq, other
            self._decoding += 1

    def rows_to_drop(self, now: float) -> list[int]:
        """Rows of running sequences that were cancelled or whose deadline passed."""
        return [row for row, s in enumerate(self._running) if s.cancelled or _expired(s, now)]

    def remove_rows(self, rows: list[int], move_row: MoveRow) -> list[Sequence]:
        """Retire `rows`, keeping both kinds packed: the last decoding row moves into a decoding
        hole, and the last row of all into the hole that leaves (or into a prefilling hole)
        (`move_row(src, dst, length)` copies its KV). Returns the removed sequences."""
        removed = []
        for row in sorted(rows, reverse=True):  # so that every row still to remove stays where it is
            removed.append(self._running[row])
            if row < self._decoding:
                self._decoding -= 1
                self._move(self._decoding, row, move_row)
                row = self._decoding
            self._move(len(self._running) - 1, row, move_row)
            self._running.pop()
        self.finished_count += len(removed)
        return removed

    def _move(self, src: int, dst: int, move_row: MoveRow) -> None:
        if src != dst:
            moved = self._running[src]
            move_row(src, dst, moved.kv_len)
            self._running[dst] = moved

    def publish_load(self, prefix_cache: PrefixCacheStats | None = None) -> None:
        with self._cond:
            waiting = len(self._waiting)
        self.load = LoadSnapshot(
            running_sequences=len(self._running),
            waiting_requests=waiting,
            kv_cache_used_tokens=sum(s.cache_len for s in self._running),
            kv_cache_capacity_tokens=self.max_batch * self.max_context,
            requests_finished=self.finished_count,
            prefix_cache=prefix_cache or self.load.prefix_cache,
        )

    def waiting_count(self) -> int:
        with self._cond:
            return len(self._waiting)


def _expired(seq: Sequence, now: float) -> bool:
    return seq.request.deadline is not None and now >= seq.request.deadline

