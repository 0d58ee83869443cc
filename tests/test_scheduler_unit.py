"""The Scheduler alone, in-process and in milliseconds: the exact queue bound, admission within the
batch, chunked prefill within the per-step budget, deadlines and cancellation, and the packing of
rows (decoding rows first) on promotion and retirement."""

from __future__ import annotations

import pytest

from engine_service.requests import Request, SamplingParams
from engine_service.scheduling.scheduler import IDLE_PREFILL_TOKENS, Scheduler
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import Prefill
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


class Swaps:
    """Records `swap_rows(a, b, length_a, length_b)` calls in place of the KV cache."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []

    def __call__(self, a: int, b: int, length_a: int, length_b: int) -> None:
        self.calls.append((a, b, length_a, length_b))


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
    assert ids(sched.rows) == ["a", "b", "c"] and sched.waiting_count() == 2
    assert sched.admit() == []  # no free row
    sched.remove_rows([1], Moves())
    assert ids(sched.admit()) == ["d"]
    assert ids(sched.rows) == ["a", "c", "d"]


def chunks(plans: list[Prefill]) -> list[tuple[str, int, int, int, bool]]:
    """(id, row, start, length, completes) of each planned chunk."""
    return [(p.seq.request_id, p.chunk.row, p.chunk.start, p.chunk.length, p.completes) for p in plans]


def run_chunks(plans: list[Prefill]) -> None:
    """What the loop does after the forward: the chunk is in the cache."""
    for p in plans:
        p.seq.cache_len = p.chunk.start + p.chunk.length


def decoding_row(sched: Scheduler) -> Sequence:
    """A sequence admitted, prefilled and decoding in row 0: steps are now bound by the budget."""
    sched.submit(first := seq("decoding", prompt_len=2))
    sched.admit()
    first.timings.prefill_started = NOW
    first.cache_len = 2
    first.generated.append(7)
    sched.promote([first], Swaps())
    return first


def test_admit_takes_every_free_row_whatever_the_prompts_cost():
    sched = scheduler(max_batch=4, queue_capacity=5, budget=25)
    for name, length in (("a", 40), ("b", 10), ("c", 1)):
        sched.submit(seq(name, prompt_len=length))
    assert ids(sched.admit()) == ["a", "b", "c"]  # the budget limits prefill per step, not admission
    assert [s.admitted for s in sched.rows] == [0, 1, 2]


def test_prompts_are_prefilled_in_chunks_within_the_budget_oldest_first():
    sched = scheduler(max_batch=4, queue_capacity=5, budget=25)
    decoding_row(sched)
    for name in "abc":
        sched.submit(seq(name, prompt_len=10))
    sched.admit()
    started: list[tuple[str, int]] = []
    start = lambda s, row: started.append((s.request_id, row))  # noqa: E731
    plans = sched.plan(start).prefills
    assert chunks(plans) == [("a", 1, 0, 10, True), ("b", 2, 0, 10, True), ("c", 3, 0, 5, False)]
    assert started == [("a", 1), ("b", 2), ("c", 3)]
    run_chunks(plans)
    for s in sched.rows:
        s.timings.prefill_started = NOW
    sched.promote([plans[0].seq, plans[1].seq], Swaps())
    assert sched.decoding == 3
    assert chunks(sched.plan(start).prefills) == [("c", 3, 5, 5, True)]  # the rest of c, at its offset
    assert len(started) == 3  # c's prefill had started: no second start


def test_with_no_row_decoding_a_step_prefills_whole_prompts_up_to_the_idle_budget():
    sched = scheduler(max_batch=4, queue_capacity=5, budget=25)
    for name in "abc":
        sched.submit(seq(name, prompt_len=1000))
    sched.admit()
    plans = sched.plan(lambda s, row: None).prefills
    assert IDLE_PREFILL_TOKENS == 2048
    assert chunks(plans) == [("a", 0, 0, 1000, True), ("b", 1, 0, 1000, True), ("c", 2, 0, 48, False)]


def test_the_idle_budget_is_the_largest_of_the_step_budget_max_context_and_idle_prefill_tokens():
    # a prompt of 4,000 tokens, each time with 3,000 the largest of the three and 2,048 the smallest
    for budget, max_context in ((3000, 64), (25, 3000)):
        sched = Scheduler(max_batch=1, max_context=max_context, queue_capacity=2, queue_retry_seconds=0.25,
                          prefill_token_budget=budget)
        sched.submit(seq("long", prompt_len=4000))
        sched.admit()
        assert chunks(sched.plan(lambda s, row: None).prefills) == [("long", 0, 0, 3000, False)], (budget, max_context)


def test_a_prompt_longer_than_the_budget_takes_several_steps_and_completes_on_the_last():
    sched = scheduler(max_batch=3, queue_capacity=5, budget=12)
    decoding_row(sched)
    sched.submit(seq("long", prompt_len=30))
    sched.submit(seq("next", prompt_len=2))
    sched.admit()
    seen = []
    for _ in range(3):
        plans = sched.plan(lambda s, row: setattr(s.timings, "prefill_started", NOW)).prefills
        seen.append(chunks(plans))
        run_chunks(plans)
    assert seen == [[("long", 1, 0, 12, False)], [("long", 1, 12, 12, False)],
                    [("long", 1, 24, 6, True), ("next", 2, 0, 2, True)]]


def test_a_chunk_starts_where_the_start_callback_left_the_cache():
    sched = scheduler(max_batch=2, queue_capacity=5, budget=100)
    sched.submit(seq("hit", prompt_len=40))
    sched.admit()

    def reuse(s: Sequence, row: int) -> None:  # as the prefix cache does on a hit of 32 tokens
        s.timings.prefill_started = NOW
        s.cache_len = 32

    assert chunks(sched.plan(reuse).prefills) == [("hit", 0, 32, 8, True)]


def test_a_prefilled_row_behind_another_prefilling_row_is_swapped_to_join_the_decoding_rows():
    sched = scheduler(max_batch=3, queue_capacity=5)
    a, b, c = seq("a", cache_len=5), seq("b", cache_len=6), seq("c", cache_len=7)
    for s in (a, b, c):
        sched.submit(s)
    sched.admit()
    swaps = Swaps()
    sched.promote([a], swaps)
    assert swaps.calls == [] and sched.decoding == 1
    sched.promote([c], swaps)  # c is in row 2, b (still prefilling) in row 1
    assert swaps.calls == [(1, 2, 6, 7)] and ids(sched.rows) == ["a", "c", "b"] and sched.decoding == 2


def test_removing_a_decoding_row_keeps_decoding_rows_before_prefilling_ones():
    sched = scheduler(max_batch=4, queue_capacity=5)
    rows = [seq(n, cache_len=i + 5) for i, n in enumerate("abcd")]
    for s in rows:
        sched.submit(s)
    sched.admit()
    sched.promote(rows[:3], Swaps())  # a, b, c decode; d prefills
    moves = Moves()
    assert ids(sched.remove_rows([0], moves)) == ["a"]
    # c (the last decoding row) fills a's row, then d (prefilling) fills c's
    assert moves.calls == [(2, 0, 7), (3, 2, 8)]
    assert ids(sched.rows) == ["c", "b", "d"] and sched.decoding == 2
    moves = Moves()
    sched.remove_rows([1, 2], moves)  # b (decoding) and d (prefilling) at once
    assert moves.calls == [] and ids(sched.rows) == ["c"] and sched.decoding == 1


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
    assert ids(sched.rows) == ["d", "b"]
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
    assert moves.calls == [] and ids(sched.rows) == ["a"]


def test_the_prefill_position_is_where_the_first_admitted_prefilling_row_stands() -> None:
    sched = scheduler(max_batch=3)
    assert sched.prefill_position == 0  # nothing prefills
    first, second, third = seq("a", 40, cache_len=16), seq("b", 40, cache_len=32), seq("c", 40, cache_len=8)
    for s in (first, second, third):
        sched.submit(s)
    sched.admit()
    assert sched.prefill_position == 16
    first.cache_len = 40
    sched.promote([first], Swaps())  # a decodes: b, admitted before c, comes next
    assert sched.prefill_position == 32
    sched.promote([second], Swaps())
    assert sched.prefill_position == 8
    sched.promote([third], Swaps())
    assert sched.prefill_position == 0  # all decode
