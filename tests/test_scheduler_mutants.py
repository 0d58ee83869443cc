"""Scheduler.wait_for_work, the decode loop's only blocking call: it returns at once while anything
runs or waits, blocks while nothing does, wakes on a submit, and answers False once stopped (found by
`make mutate`, docs/mutation-testing.md; the admission and retirement rules are in
test_scheduler_unit.py)."""

from __future__ import annotations

import threading

from engine_service.requests import Request, SamplingParams
from engine_service.scheduling.scheduler import LoadSnapshot, Scheduler
from engine_service.scheduling.sequence import Sequence

WAIT = 5.0  # seconds before a test gives up on a thread (passing runs take milliseconds)
BLOCKED = 0.05  # how long a blocked waiter is given to (wrongly) return


def sequence(request_id: str = "a") -> Sequence:
    return Sequence(Request(request_id=request_id, prompt_ids=(1, 2), max_new_tokens=4, sampling=SamplingParams(),
                            stop_token_ids=frozenset(), ignore_eos=True, deadline=None), sink=None)


def scheduler() -> Scheduler:
    return Scheduler(max_batch=2, max_context=16, queue_capacity=4, queue_retry_seconds=0.5, prefill_token_budget=64)


class Waiter:
    """wait_for_work on its own thread, so a test can see whether it blocks."""

    def __init__(self, sched: Scheduler) -> None:
        self.result: list[bool] = []
        self.thread = threading.Thread(target=lambda: self.result.append(sched.wait_for_work()), daemon=True)
        self.thread.start()

    def returned(self, within: float) -> bool:
        self.thread.join(within)
        return not self.thread.is_alive()


def test_returns_at_once_while_requests_wait() -> None:
    sched = scheduler()
    sched.submit(sequence())
    waiter = Waiter(sched)
    assert waiter.returned(WAIT) and waiter.result == [True]


def test_returns_at_once_while_sequences_run() -> None:
    sched = scheduler()
    sched.submit(sequence())
    sched.admit()
    assert sched.rows and sched.waiting_count() == 0
    waiter = Waiter(sched)
    assert waiter.returned(WAIT) and waiter.result == [True]


def test_blocks_while_idle_and_wakes_on_submit() -> None:
    sched = scheduler()
    waiter = Waiter(sched)
    assert not waiter.returned(BLOCKED)
    sched.wake()  # a wake with nothing to do leaves it waiting
    assert not waiter.returned(BLOCKED)
    sched.submit(sequence())
    assert waiter.returned(WAIT) and waiter.result == [True]


def test_stop_releases_a_blocked_waiter_and_every_later_one() -> None:
    sched = scheduler()
    waiter = Waiter(sched)
    assert not waiter.returned(BLOCKED)
    sched.stop()
    assert waiter.returned(WAIT) and waiter.result == [False]
    sched.submit(sequence())  # stopped wins over work waiting
    later = Waiter(sched)
    assert later.returned(WAIT) and later.result == [False]


def test_load_before_the_first_step_shows_an_empty_cache_of_the_full_capacity() -> None:
    sched = Scheduler(max_batch=3, max_context=16, queue_capacity=4, queue_retry_seconds=0.5, prefill_token_budget=64)
    assert sched.load == LoadSnapshot(running_sequences=0, waiting_requests=0, kv_cache_used_tokens=0,
                                      kv_cache_capacity_tokens=48, requests_finished=0)


def test_published_load_counts_the_waiting_requests() -> None:
    sched = scheduler()
    for name in "abc":
        sched.submit(sequence(name))
    sched.admit()
    sched.publish_load()
    assert (sched.load.running_sequences, sched.load.waiting_requests) == (2, 1)


def test_chunks_that_exactly_spend_the_budget_leave_nothing_for_the_next_prompt() -> None:
    sched = Scheduler(max_batch=4, max_context=16, queue_capacity=4, queue_retry_seconds=0.5, prefill_token_budget=64)
    for name in "abcd":
        sched.submit(Sequence(Request(request_id=name, prompt_ids=(1,) * 32, max_new_tokens=4,
                                      sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True,
                                      deadline=None), sink=None))
    sched.admit()
    sched.promote([sched.rows[0]], lambda *rows: None)  # row 0 ("a") had its first token: b and c prefill within the budget
    plans = sched.plan(lambda s, row: None).prefills
    assert [(p.seq.request_id, p.chunk.length) for p in plans] == [("b", 32), ("c", 32)]  # 64 tokens: d waits
