"""Waiting and running sequences: admission, chunked prefill, the bounded queue, deadlines and
cancellation.

The event loop thread calls `submit` and `wake`; the decode loop thread calls everything else.
Running sequences are kept packed in KV cache rows 0..n-1 (see kv_cache.py): rows 0..decoding-1
decode one token a step (the traced decode reads them as one batch), and the rows after them are
still prefilling their prompts. Each step, prompts are prefilled in chunks within the per-step
prefill token budget, oldest admission first, so a long prompt takes several steps and the
decoding rows go on in every one of them (`plan_prefill`); a prompt whose last chunk ran has its
first token and its row joins the decoding ones (`promote`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_service.model.kv_cache import PromptChunk
from engine_service.scheduling.prefix_cache import PrefixCacheStats
from engine_service.scheduling.sequence import Sequence
from shared.errors import QueueFull

# A step with no decoding row prefills at least this many prompt tokens: a wave of 128-token
# prompts arriving together at an idle engine prefilled 1.5x faster in one step than in 96-token
# chunks, and no stream is waiting on it.
IDLE_PREFILL_TOKENS = 2048

MoveRow = Callable[[int, int, int], None]  # (src, dst, length): KVCache.move_row
SwapRows = Callable[[int, int, int, int], None]  # (a, b, length_a, length_b): KVCache.swap_rows


@dataclass(frozen=True)
class Prefill:
    """One step's chunk of a sequence's prompt."""

    seq: Sequence
    chunk: PromptChunk

    @property
    def completes(self) -> bool:
        """The chunk ends the prompt, so this step samples the sequence's first token."""
        return self.chunk.start + self.chunk.length == len(self.seq.request.prompt_ids)


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
                 prefill_token_budget: int) -> None:
        self.max_batch = max_batch
        self.max_context = max_context
        self.queue_capacity = queue_capacity
        self.queue_retry_seconds = queue_retry_seconds
        self.prefill_token_budget = prefill_token_budget
        self.running: list[Sequence] = []
        self.decoding = 0  # running[:decoding] decode; the rest are prefilling
        self._admissions = 0
        self._waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.finished_count = 0
        self.load = LoadSnapshot(kv_cache_capacity_tokens=max_batch * max_context)

    # -- event loop side -------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a parsed request, or raise QueueFull when the waiting queue is at capacity.
        Requests that free batch rows will take at the next step do not count against it."""
        with self._cond:
            depth = len(self._waiting)
            free_rows = max(self.max_batch - len(self.running), 0)  # a racy read is fine: off by a step
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
            while not self._stopped and not self.running and not self._waiting:
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
        """Move waiting sequences into free rows, oldest first; they are appended to `running`
        (after every decoding row) and prefill from the next `plan_prefill` on."""
        admitted: list[Sequence] = []
        with self._cond:
            while self._waiting and len(self.running) + len(admitted) < self.max_batch:
                seq = self._waiting.popleft()
                seq.admitted = self._admissions
                self._admissions += 1
                admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def plan_prefill(self, start: Callable[[Sequence, int], None]) -> list[Prefill]:
        """This step's prompt chunks: the prefilling rows in admission order, each given the rest of
        its prompt or what remains of the budget, until the budget is spent. The budget is the
        prefill token budget while any row decodes, else at least max_context and
        IDLE_PREFILL_TOKENS. `start(seq, row)` is called for a sequence about to prefill its first
        chunk (it may put a cached prefix into the row and advance `cache_len`)."""
        # the budget bounds how long decoding rows wait for a step; with none, nobody waits, and
        # whole prompts (a wave of them, or one of any allowed length) go in one piece: larger
        # matmuls are faster per token
        budget = self.prefill_token_budget if self.decoding else max(self.prefill_token_budget, self.max_context,
                                                                     IDLE_PREFILL_TOKENS)
        plans: list[Prefill] = []
        for row in sorted(range(self.decoding, len(self.running)), key=lambda r: self.running[r].admitted):
            if budget == 0:
                break
            seq = self.running[row]
            if seq.timings.prefill_started is None:
                start(seq, row)
            length = min(len(seq.request.prompt_ids) - seq.cache_len, budget)
            plans.append(Prefill(seq, PromptChunk(row, seq.cache_len, length)))
            budget -= length
        return plans

    def promote(self, seqs: list[Sequence], swap_rows: SwapRows) -> None:
        """`seqs`, prefilling rows that have just produced their first token, join the decoding
        rows: each is swapped with the first prefilling row unless it is that row already."""
        for seq in seqs:
            row, first = self.running.index(seq), self.decoding
            if row != first:
                other = self.running[first]
                swap_rows(first, row, other.cache_len, seq.cache_len)
                self.running[first], self.running[row] = seq, other
            self.decoding += 1

    def rows_to_drop(self, now: float) -> list[int]:
        """Rows of running sequences that were cancelled or whose deadline passed."""
        return [row for row, s in enumerate(self.running) if s.cancelled or _expired(s, now)]

    def remove_rows(self, rows: list[int], move_row: MoveRow) -> list[Sequence]:
        """Retire `rows`, keeping both kinds packed: the last decoding row moves into a decoding
        hole, and the last row of all into the hole that leaves (or into a prefilling hole)
        (`move_row(src, dst, length)` copies its KV). Returns the removed sequences."""
        removed = []
        for row in sorted(rows, reverse=True):  # so that every row still to remove stays where it is
            removed.append(self.running[row])
            if row < self.decoding:
                self.decoding -= 1
                self._move(self.decoding, row, move_row)
                row = self.decoding
            self._move(len(self.running) - 1, row, move_row)
            self.running.pop()
        self.finished_count += len(removed)
        return removed

    def _move(self, src: int, dst: int, move_row: MoveRow) -> None:
        if src != dst:
            moved = self.running[src]
            move_row(src, dst, moved.cache_len)
            self.running[dst] = moved

    def publish_load(self, prefix_cache: PrefixCacheStats | None = None) -> None:
        with self._cond:
            waiting = len(self._waiting)
        self.load = LoadSnapshot(
            running_sequences=len(self.running),
            waiting_requests=waiting,
            kv_cache_used_tokens=sum(s.cache_len for s in self.running),
            kv_cache_capacity_tokens=self.max_batch * self.max_context,
            requests_finished=self.finished_count,
            prefix_cache=prefix_cache or self.load.prefix_cache,
        )

    def waiting_count(self) -> int:
        with self._cond:
            return len(self._waiting)


def _expired(seq: Sequence, now: float) -> bool:
    return seq.request.deadline is not None and now >= seq.request.deadline

