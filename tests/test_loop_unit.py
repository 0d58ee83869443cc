"""The decode loop's recovery policy, step by step, in-process and in milliseconds: a DecodeLoop
over a real Scheduler with a fake model runner (deterministic logits, a KV cache that records
row moves). Each test calls `step()` itself: no thread, no timing."""

from __future__ import annotations

import dataclasses
import time

import torch

from engine_service.faults import FaultInjector, FaultPlan
from engine_service.generation.controls import FinishReason
from engine_service.requests import Request, SamplingParams
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import DecodeLoop
from engine_service.runtime.model_runner import StepLogits
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import StepPlan
from shared.errors import DeadlineExceeded, SequenceError
from tests.step_plans import unpack

VOCAB = 32
END = 31  # never produced by the fake model, so only max_new_tokens ends a sequence


class FakeCache:
    def __init__(self) -> None:
        self.moves: list[tuple[int, int, int]] = []

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.moves.append((src, dst, length))

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        self.moves.append((a, b, -1))


class FakeRunner:
    """Greedy logits whose argmax is a pure function of the sequence: (first prompt id + its
    length so far) mod 30. Records which sequences each forward ran."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.cache = FakeCache()
        self.forwards: list[tuple[list[str], int]] = []

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        """(the decoding rows and the prefilling ones, how many decode) for each forward"""
        self.forwards.append(([s.request_id for s in decoding] + [p.seq.request_id for p in prefills], len(decoding)))
        producing = decoding + [p.seq for p in prefills if p.completes]
        logits = torch.zeros(len(producing), VOCAB)
        for row, s in enumerate(producing):
            logits[row, expected_token(s.request.prompt_ids[0], s.total_len)] = 1.0
        return StepLogits(logits)


def expected_token(first: int, total_len: int) -> int:
    return (first + total_len) % 30


def request(request_id: str, first: int, max_new: int = 50, prompt_len: int = 4,
            deadline: float | None = None) -> Request:
    return Request(request_id=request_id, prompt_ids=(first,) + (1,) * (prompt_len - 1), max_new_tokens=max_new,
                   sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=deadline)


class Harness:
    def __init__(self, max_batch: int = 4, faults: FaultPlan | None = None) -> None:
        self.runner = FakeRunner()
        self.scheduler = Scheduler(max_batch=max_batch, max_context=256, queue_capacity=8, queue_retry_seconds=0.5,
                                   prefill_token_budget=1024)
        self.delivered: list[list[Delta]] = []
        self.loop = DecodeLoop(self.runner, self.scheduler, FaultInjector(faults or FaultPlan()),  # type: ignore[arg-type]
                               frozenset({END}), self.delivered.append, on_fatal=self._fatal)

    @staticmethod
    def _fatal(exc: BaseException) -> None:
        raise AssertionError(f"the loop called on_fatal: {exc!r}")

    def submit(self, *requests: Request) -> list[Sequence]:
        seqs = [Sequence(r, sink=None) for r in requests]
        for s in seqs:
            self.scheduler.submit(s)
        return seqs

    def step(self) -> dict[str, Delta]:
        self.loop.step()
        return {e.seq.request_id: e for e in self.delivered[-1]}

    def load(self) -> tuple[int, int, int]:
        load = self.scheduler.load
        return load.running_sequences, load.waiting_requests, load.kv_cache_used_tokens

    def running(self) -> list[str]:
        return [s.request_id for s in self.scheduler.rows]


def tokens_for(seq: Sequence) -> list[int]:
    """What the fake model makes `seq` generate, alone or in any batch."""
    prompt = len(seq.request.prompt_ids)
    return [expected_token(seq.request.prompt_ids[0], prompt + i) for i in range(seq.request.max_new_tokens)]


def test_a_sequence_error_retires_its_row_in_the_same_step_and_the_others_go_on():
    h = Harness(faults=FaultPlan(sequence_error_steps=frozenset({3})))  # row 0 fails at step 3
    a, b, c = h.submit(request("a", 5), request("b", 6, max_new=8), request("c", 7, max_new=9))
    h.step()
    h.step()
    assert h.running() == ["a", "b", "c"] and len(a.generated) == 2
    out = h.step()
    err = out["a"].error
    assert isinstance(err, SequenceError) and out["a"].tokens == ()
    assert err.metadata["requestId"] == "a" and err.metadata["generatedTokens"] == "2"
    assert "step 3" in err.metadata["cause"]
    # freed at once: its row (c moved into it), its KV, its place in the load
    assert h.running() == ["c", "b"]
    assert h.runner.cache.moves == [(2, 0, c.cache_len)]
    assert h.load() == (2, 0, b.cache_len + c.cache_len)
    assert h.scheduler.finished_count == 1
    # the others got this step's token, and go on to their full answers untouched
    assert out["b"].tokens == (b.generated[-1],) and len(b.generated) == 3
    while h.scheduler.rows:
        out = h.step()
        assert "a" not in out
    assert len(a.generated) == 2
    assert b.generated == tokens_for(b) and c.generated == tokens_for(c)
    assert h.load() == (0, 0, 0)


def test_a_sequence_error_on_the_last_row_moves_nothing():
    h = Harness(faults=FaultPlan(sequence_error_steps=frozenset({2})))
    only, = h.submit(request("only", 3))
    h.step()
    out = h.step()
    assert isinstance(out["only"].error, SequenceError)
    assert h.running() == [] and h.load() == (0, 0, 0) and h.runner.cache.moves == []


def test_a_cancelled_sequence_frees_its_row_at_the_next_step():
    h = Harness()
    a, b = h.submit(request("a", 2), request("b", 3))
    h.step()
    h.step()
    a.cancelled = True  # what Engine.release does for a caller that left
    out = h.step()
    assert out["a"].error is None and out["a"].tokens == () and out["a"].finish is None
    assert h.running() == ["b"] and h.load() == (1, 0, b.cache_len)
    assert h.runner.forwards[-1] == (["b"], 1)  # the cancelled row ran no forward this step
    assert len(a.generated) == 2


def test_a_cancelled_queued_request_is_dropped_before_it_is_prefilled():
    h = Harness(max_batch=1)
    running, queued = h.submit(request("running", 2), request("queued", 3))
    h.step()
    queued.cancelled = True
    out = h.step()
    assert out["queued"].error is None and out["queued"].tokens == ()
    assert queued.timings.prefill_started is None and h.load() == (1, 0, running.cache_len)
    running.cancelled = True
    h.step()
    assert h.load() == (0, 0, 0)
    assert all("queued" not in ids for ids, _ in h.runner.forwards)


def test_an_expired_deadline_ends_the_sequence_with_deadline_exceeded_and_frees_it():
    h = Harness()
    a, b = h.submit(request("a", 2, deadline=time.monotonic() + 3600), request("b", 3))
    h.step()
    h.step()
    h.step()
    a.request = dataclasses.replace(a.request, deadline=time.monotonic() - 0.001)  # its deadline has passed
    b_cached = b.cache_len
    out = h.step()
    err = out["a"].error
    assert isinstance(err, DeadlineExceeded) and err.reason == "DEADLINE_EXCEEDED"
    assert err.metadata == {"requestId": "a", "generatedTokens": "3"}
    assert h.running() == ["b"] and h.load() == (1, 0, b.cache_len)
    assert h.runner.cache.moves == [(1, 0, b_cached)]  # dropped before the forward: b's KV as it was
    assert len(a.generated) == 3 and len(b.generated) == 4


def test_a_request_whose_deadline_passed_in_the_queue_is_never_prefilled():
    h = Harness(max_batch=1)
    blocker, late = h.submit(request("blocker", 2), request("late", 3, deadline=time.monotonic() - 0.001))
    out = h.step()
    err = out["late"].error
    assert isinstance(err, DeadlineExceeded) and err.metadata == {"requestId": "late", "generatedTokens": "0"}
    assert late.timings.prefill_started is None and late.generated == []
    assert h.load() == (1, 0, blocker.cache_len)


def test_finished_sequences_are_retired_and_their_rows_reused():
    h = Harness(max_batch=2)
    short, long_, queued = h.submit(request("short", 4, max_new=2), request("long", 5, max_new=6),
                                    request("queued", 6, max_new=3))
    h.step()
    out = h.step()
    assert out["short"].finish is FinishReason.LENGTH and short.generated == tokens_for(short)
    assert h.running() == ["long"] and h.runner.cache.moves == [(1, 0, long_.cache_len)]
    out = h.step()  # the freed row takes the queued request: long decodes, queued prefills
    assert h.runner.forwards[-1] == (["long", "queued"], 1)
    while h.scheduler.rows:
        h.step()
    assert long_.generated == tokens_for(long_) and queued.generated == tokens_for(queued)
    assert h.load() == (0, 0, 0) and h.scheduler.finished_count == 3
