"""What a test's fake model runner reads from a step's plan (engine_service/scheduling/step_plan.py)."""

from __future__ import annotations

from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import Prefill, StepPlan


def unpack(plan: StepPlan) -> tuple[list[Sequence], tuple[Prefill, ...], list[list[int]] | None]:
    """The decoding sequences (by row), the prompt chunks, and the drafts (None: a plain step)."""
    drafts = [list(d.draft) for d in plan.decodes] if plan.speculative else None
    return [d.seq for d in plan.decodes], plan.prefills, drafts
