"""The Scheduler alone, in-process and in milliseconds: the exact queue bound, admission within the
batch and the prefill budget, deadlines and cancellation, and the packing of rows on retirement."""

from __future__ import annotations

import pytest

from engine_service.requests import Request, SamplingParams
from engine_service.scheduler import Scheduler
from engine_service.sequence import Sequence
from shared.errors import QueueFull

NOW = 1000.0  # a monotonic clock reading: the scheduler takes `now` as an argument


def seq(request_id: str, prompt_len: int = 3, deadline: float | None = None, cache_len: int = 0) -> Sequence:
    request = Request(request_id=request_id, prompt_ids=tuple(range(1, prompt_len + 1)), max_new_tokens=10,
                      sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=deadline)
    return Sequence(request, sink=None, cache_len=cache_len)


def scheduler(max_batch: int = 2, queue_capacity: int = 3, budget: int = 1000) -> Scheduler:
    return Scheduler(max_batch=max_batch, max_context=64, queue_capacity=queue_capacity, queue_retry_seconds=0.25,
                     prefill_token_budget=budget)


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


class Moves:
    """Records `move_row(src, dst, length)` calls in place of the KV cache."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, src: int, dst: int, length: int) -> None:
        self.calls.append((src, dst, length))


# -- the queue bound: capacity + the rows free at the next step, not one more, not one less ----

def test_an_idle_scheduler_accepts_capacity_plus_free_rows_and_refuses_the_next():
    sched = scheduler(max_batch=2, queue_capacity=3)
    for i in range(5):  # 3 queued + 2 that free rows take at the next step
        sched.submit(seq(f"r{i}"))
    with pytest.raises(QueueFull) as caught:
        sched.submit(seq("r5"))
    assert caught.value.metadata == {"queueDepth": "5", "queueCapacity": "3"}
    assert caught.value.retry_delay == 0.25
    assert sched.waiting_count() == 5  # the refused request was not queued


def test_running_rows_leave_exactly_the_queue_capacity():
    sched = scheduler(max_batch=2, queue_capacity=3)
    sched.submit(seq("a"))
    sched.submit(seq("b"))
    assert ids(sched.admit()) == ["a", "b"]
    for i in range(3):
        sched.submit(seq(f"q{i}"))
    with pytest.raises(QueueFull) as caught:
        sched.submit(seq("q3"))
    assert caught.value.metadata == {"queueDepth": "3", "queueCapacity": "3"}
    # a retired row frees exactly one place
    sched.remove_rows([0], Moves())
    sched.submit(seq("q3"))
    with pytest.raises(QueueFull) as caught:
        sched.submit(seq("q4"))
    assert caught.value.metadata == {"queueDepth": "4", "queueCapacity": "3"}


def test_a_queue_of_one_behind_a_full_batch_takes_one():
    sched = scheduler(max_batch=1, queue_capacity=1)
    sched.submit(seq("running"))
    sched.admit()
    sched.submit(seq("queued"))
    with pytest.raises(QueueFull) as caught:
        sched.submit(seq("refused"))
    assert caught.value.metadata == {"queueDepth": "1", "queueCapacity": "1"}


# -- admission -------------------------------------------------------------------------------

def test_admit_fills_free_rows_oldest_first():
    sched = scheduler(max_batch=3, queue_capacity=5)
    for name in "abcde":
        sched.submit(seq(name))
    assert ids(sched.admit()) == ["a", "b", "c"]
    assert ids(sched.running) == ["a", "b", "c"] and sched.waiting_count() == 2
    assert sched.admit() == []  # no free row
    sched.remove_rows([1], Moves())
    assert ids(sched.admit()) == ["d"]
    assert ids(sched.running) == ["a", "c", "d"]


def test_admit_stops_at_the_prefill_token_budget_but_always_takes_one():
    # the padded prefill costs longest prompt x rows: 10 x 2 = 20 fits 25, 10 x 3 = 30 does not
    sched = scheduler(max_batch=4, queue_capacity=5, budget=25)
    for name in "abc":
        sched.submit(seq(name, prompt_len=10))
    assert ids(sched.admit()) == ["a", "b"]
    assert ids(sched.admit()) == ["c"]  # the next step takes the rest
    over = scheduler(max_batch=4, queue_capacity=5, budget=25)
    over.submit(seq("long", prompt_len=40))
    over.submit(seq("short", prompt_len=1))
    assert ids(over.admit()) == ["long"]  # one prompt over the budget is still admitted, alone
    assert ids(over.admit()) == ["short"]


def test_a_short_prompt_after_a_long_one_is_priced_at_the_longest():
    sched = scheduler(max_batch=4, queue_capacity=5, budget=25)
    sched.submit(seq("long", prompt_len=12))
    sched.submit(seq("short", prompt_len=1))
    sched.submit(seq("short2", prompt_len=1))
    assert ids(sched.admit()) == ["long", "short"]  # 12 x 2 = 24 fits; 12 x 3 = 36 does not


# -- deadlines and cancellation ---------------------------------------------------------------

def test_queued_sequences_past_their_deadline_or_cancelled_are_dropped():
    sched = scheduler(max_batch=2, queue_capacity=5)
    expired, at_deadline, later, free, cancelled = (
        seq("expired", deadline=NOW - 1), seq("at-deadline", deadline=NOW), seq("later", deadline=NOW + 0.001),
        seq("no-deadline"), seq("cancelled"))
    for s in (expired, at_deadline, later, free, cancelled):
        sched.submit(s)
    cancelled.cancelled = True
    assert ids(sched.take_dropped_waiting(NOW)) == ["expired", "at-deadline", "cancelled"]
    assert sched.waiting_count() == 2 and sched.finished_count == 3
    assert ids(sched.admit()) == ["later", "no-deadline"]


def test_running_rows_past_their_deadline_or_cancelled_are_the_rows_to_drop():
    sched = scheduler(max_batch=4, queue_capacity=1)
    seqs = [seq("keep", deadline=NOW + 5), seq("expired", deadline=NOW - 0.5), seq("cancelled"), seq("no-deadline")]
    for s in seqs:
        sched.submit(s)
    sched.admit()
    assert sched.rows_to_drop(NOW) == [1]
    seqs[2].cancelled = True
    assert sched.rows_to_drop(NOW) == [1, 2]
    assert sched.rows_to_drop(NOW + 5) == [0, 1, 2]  # a deadline is passed at its very instant


# -- retiring rows keeps the running rows packed ----------------------------------------------

def test_remove_rows_moves_the_last_row_into_each_hole_and_publishes_the_load():
    sched = scheduler(max_batch=4, queue_capacity=1)
    a, b, c, d = seq("a", cache_len=5), seq("b", cache_len=6), seq("c", cache_len=7), seq("d", cache_len=8)
    for s in (a, b, c, d):
        sched.submit(s)
    sched.admit()
    moves = Moves()
    assert ids(sched.remove_rows([0, 2], moves)) == ["c", "a"]
    assert moves.calls == [(3, 2, 8), (2, 0, 8)]  # d fills c's row, then a's
    assert ids(sched.running) == ["d", "b"]
    sched.publish_load()
    load = sched.load
    assert (load.running_sequences, load.waiting_requests, load.kv_cache_used_tokens) == (2, 0, 6 + 8)
    assert (load.kv_cache_capacity_tokens, load.requests_finished) == (4 * 64, 2)


def test_removing_the_last_row_moves_nothing():
    sched = scheduler(max_batch=2, queue_capacity=1)
    sched.submit(seq("a", cache_len=3))
    sched.submit(seq("b", cache_len=4))
    sched.admit()
    moves = Moves()
    sched.remove_rows([1], moves)
    assert moves.calls == [] and ids(sched.running) == ["a"]
