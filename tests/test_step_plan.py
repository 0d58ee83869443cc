"""The step plan alone: every scheduled sequence's KV row and its slice of the step's logits, built
by the scheduler once a step, and the layout it refuses (engine_service/scheduling/step_plan.py)."""

from __future__ import annotations

import pytest

from engine_service.model.kv_cache import PromptChunk
from engine_service.requests import Request, SamplingParams
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import DecodeRow, PlanError, Prefill, StepPlan


def seq(request_id: str, prompt_len: int = 8) -> Sequence:
    return Sequence(Request(request_id=request_id, prompt_ids=tuple(range(1, prompt_len + 1)), max_new_tokens=10,
                            sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None),
                    sink=None)


def layout(plan: StepPlan) -> list[tuple[str, int, int, int]]:
    """(request id, KV row, first logits row, logits rows) of what produces tokens, in order."""
    return [(e.seq.request_id, e.row, e.logits.start, e.logits.stop - e.logits.start) for e in plan.producing]


def test_a_plain_plan_gives_each_decode_row_one_logits_row_then_each_completing_prompt_one() -> None:
    a, b, c, d = seq("a"), seq("b"), seq("c", 8), seq("d", 20)
    plan = StepPlan.build([a, b], [(c, PromptChunk(2, 0, 8)), (d, PromptChunk(3, 0, 12))])
    assert [(e.seq.request_id, e.row, e.draft) for e in plan.decodes] == [("a", 0, ()), ("b", 1, ())]
    assert layout(plan) == [("a", 0, 0, 1), ("b", 1, 1, 1), ("c", 2, 2, 1)]  # d's chunk does not end its prompt
    assert plan.prefills[1].logits is None and not plan.prefills[1].completes
    assert (plan.sampled_rows, plan.prefill_tokens, plan.speculative) == (3, 20, False)


def test_a_speculative_plan_gives_each_decode_row_one_more_logits_row_per_draft_token() -> None:
    a, b, c = seq("a"), seq("b"), seq("c", 4)
    plan = StepPlan.build([a, b], [(c, PromptChunk(2, 0, 4))], drafts=[[7, 8, 9], []])
    assert plan.speculative and [e.draft for e in plan.decodes] == [(7, 8, 9), ()]
    assert layout(plan) == [("a", 0, 0, 4), ("b", 1, 4, 1), ("c", 2, 5, 1)]
    assert plan.sampled_rows == 6


@pytest.mark.parametrize(("build", "says"), [
    (lambda a, b: StepPlan.build([a], [], drafts=[[1], [2]]), "step plan: 2 drafts for 1 decode rows"),
    (lambda a, b: StepPlan.build([a], [(b, PromptChunk(0, 0, 8))]),
     "prefill rows [0] repeat a row or overlap the 1 decode rows"),
    (lambda a, b: StepPlan.build([], [(a, PromptChunk(1, 0, 4)), (b, PromptChunk(1, 0, 4))]),
     "prefill rows [1, 1] repeat a row or overlap the 0 decode rows"),
    (lambda a, b: StepPlan.build([a, a], []), "a sequence is scheduled twice"),
    (lambda a, b: StepPlan.build([], [(a, PromptChunk(0, 4, 5))]), "a: chunk [4, 9) of a 8-token prompt"),
    (lambda a, b: StepPlan.build([], [(a, PromptChunk(0, 0, 0))]), "a: chunk [0, 0) of a 8-token prompt"),
    (lambda a, b: StepPlan((DecodeRow(a, 1, slice(0, 1)),), ()).check(), "decode rows [1] are not 0..0"),
    (lambda a, b: StepPlan((DecodeRow(a, 0, slice(1, 2)),), ()).check(),
     "a: logits slice(1, 2, None) where row 0 comes next"),
    (lambda a, b: StepPlan((DecodeRow(a, 0, slice(0, 0)),), ()).check(),
     "a: logits slice(0, 0, None) where row 0 comes next"),  # an empty slice gives no token
    (lambda a, b: StepPlan((), (Prefill(a, PromptChunk(0, 0, 4), slice(0, 1)),)).check(),
     "a chunk that does not end its prompt has logits"),
    (lambda a, b: StepPlan((DecodeRow(a, 1, slice(0, 1)), DecodeRow(a, 0, slice(1, 2))), ()).check(),
     "decode rows [1, 0] are not 0..1; a sequence is scheduled twice"),  # every problem, each named
])
def test_a_plan_that_breaks_the_layout_is_refused_naming_what_broke(build, says) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError) as refused:
        build(seq("a"), seq("b"))
    message = str(refused.value)
    assert message == says or message == f"step plan breaks the row layout: {says}"


def test_the_scheduler_plans_decode_rows_first_and_prompts_in_admission_order_within_the_budget() -> None:
    sched = Scheduler(max_batch=4, max_context=64, queue_capacity=4, queue_retry_seconds=0.5, prefill_token_budget=10)
    for name in "abcd":
        sched.submit(seq(name, 8))
    sched.admit()
    sched.promote([sched.rows[0]], lambda *rows: None)  # a decodes
    started: list[tuple[str, int]] = []
    plan = sched.plan(lambda s, row: started.append((s.request_id, row)),
                      drafts=lambda decoding, prefilling: [[5, 6]] if decoding else None)
    assert [(e.seq.request_id, e.row, e.draft) for e in plan.decodes] == [("a", 0, (5, 6))]
    assert [(p.seq.request_id, p.chunk) for p in plan.prefills] == [("b", PromptChunk(1, 0, 8)),
                                                                      ("c", PromptChunk(2, 0, 2))]
    assert started == [("b", 1), ("c", 2)]
    assert layout(plan) == [("a", 0, 0, 3), ("b", 1, 3, 1)]
    assert sched.rows == tuple(sched.rows) and [s.request_id for s in sched.rows] == ["a", "b", "c", "d"]


def test_retire_promotes_the_completed_prompts_then_removes_the_finished() -> None:
    sched = Scheduler(max_batch=4, max_context=64, queue_capacity=4, queue_retry_seconds=0.5, prefill_token_budget=64)
    for name in "abc":
        sched.submit(seq(name, 8))
    sched.admit()
    plan = sched.plan(lambda s, row: None)
    for p in plan.prefills:
        p.seq.cache_len = 8
    swaps: list[tuple[int, ...]] = []
    moves: list[tuple[int, ...]] = []
    sched.retire(plan, [sched.rows[1]], lambda *rows: swaps.append(rows), lambda *rows: moves.append(rows))
    assert sched.decoding == 2 and [s.request_id for s in sched.rows] == ["a", "c"]
    assert swaps == [] and moves == [(2, 1, 8)]  # c, the last decoding row, fills b's hole
