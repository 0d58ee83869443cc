"""Waiting and running sequences: admission, the bounded queue, deadlines and cancellation.

The event loop thread calls `submit` and `wake`; the decode loop thread calls everything else.
Running sequences are kept packed in KV cache rows 0..n-1 (see KVCache).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from engine_service.sequence import Sequence
from shared.errors import QueueFull


@dataclass(frozen=True)
class LoadSnapshot:
    running_sequences: int = 0
    waiting_requests: int = 0
    kv_cache_used_tokens: int = 0
    kv_cache_capacity_tokens: int = 0
    requests_finished: int = 0


class Scheduler:
    def __init__(self, max_batch: int, max_context: int, queue_capacity: int, queue_retry_seconds: float,
                 prefill_token_budget: int) -> None:
        self.max_batch = max_batch
        self.max_context = max_context
        self.queue_capacity = queue_capacity
        self.queue_retry_seconds = queue_retry_seconds
        self.prefill_token_budget = prefill_token_budget
        self.running: list[Sequence] = []
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
        """Move waiting sequences into free rows, oldest first, within the prefill token budget.
        The admitted sequences are appended to `running` (their rows follow the old ones)."""
        admitted: list[Sequence] = []
        longest = 0
        with self._cond:
            while self._waiting and len(self.running) + len(admitted) < self.max_batch:
                prompt = len(self._waiting[0].request.prompt_ids)
                longest_after = max(longest, prompt)
                if admitted and longest_after * (len(admitted) + 1) > self.prefill_token_budget:
                    break
                admitted.append(self._waiting.popleft())
                longest = longest_after
        self.running.extend(admitted)
        return admitted

    def rows_to_drop(self, now: float) -> list[int]:
        """Rows of running sequences that were cancelled or whose deadline passed."""
        return [row for row, s in enumerate(self.running) if s.cancelled or _expired(s, now)]

    def remove_rows(self, rows: list[int], move_row) -> list[Sequence]:  # type: ignore[no-untyped-def]
        """Retire `rows`, keeping the rest packed: the last running row moves into each hole
        (`move_row(src, dst, length)` copies its KV). Returns the removed sequences."""
        removed = []
        for row in sorted(rows, reverse=True):
            last = len(self.running) - 1
            removed.append(self.running[row])
            if row != last:
                moved = self.running[last]
                move_row(last, row, moved.cache_len)
                self.running[row] = moved
            self.running.pop()
        self.finished_count += len(removed)
        return removed

    def publish_load(self) -> None:
        with self._cond:
            waiting = len(self._waiting)
        self.load = LoadSnapshot(
            running_sequences=len(self.running),
            waiting_requests=waiting,
            kv_cache_used_tokens=sum(s.cache_len for s in self.running),
            kv_cache_capacity_tokens=self.max_batch * self.max_context,
            requests_finished=self.finished_count,
        )

    def waiting_count(self) -> int:
        with self._cond:
            return len(self._waiting)


def _expired(seq: Sequence, now: float) -> bool:
    return seq.request.deadline is not None and now >= seq.request.deadline

