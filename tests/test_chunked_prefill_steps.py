"""benchmarks/chunked_prefill.py's reading of the engine's sliced steps (`sliced_prompts`): what
the long prompt's TTFT beside the streams is made of."""

from __future__ import annotations

import pytest

from benchmarks.chunked_prefill import SlicedPrompt, sliced_prompts

US = 1e-6  # times of day as seconds since the epoch in a float carry about 0.1 us of rounding


def step(at: str, ms: float, decode_ms: float | None, sublayers: tuple[int, int], rows: tuple[int, int]) -> dict:
    """A `sliced_prefill_step` event as the engine logs it, as its step ends at `at` (seconds past 12:00:00)."""
    return {"event": "sliced_prefill_step", "timestamp": f"2026-12-07T12:00:{at}Z", "ms": ms,
            "decode_part_ms": decode_ms, "sublayers": list(sublayers), "rows": list(rows)}


def test_each_prompt_from_its_first_span_is_its_work_decoding_parts_time_between_and_step_factor():
    events = [
        {"event": "prefill_step", "timestamp": "2026-12-07T12:00:00.500000Z", "ms": 20.0},  # not a sliced step
        # the first prompt: 3 steps of 30 / 40 / 35 ms ending at .030, .072 and .110 (2 and 3 ms between)
        step("01.030000", 30.0, 10.0, (0, 1), (0, 512)),
        step("01.072000", 40.0, 12.0, (1, 3), (512, 256)),
        step("01.110000", 35.0, 11.0, (3, 60), (256, 0)),
        # the second: 2 steps, its first span from sublayer 0 row 0 again
        step("02.050000", 33.0, 11.0, (0, 2), (0, 0)),
        step("02.090000", 36.0, 9.0, (2, 60), (0, 0)),
    ]
    first, second = sliced_prompts(events)
    assert first.steps == 3
    assert first.work == pytest.approx((30 + 40 + 35 - 10 - 12 - 11) / 1e3)
    assert first.decoding == pytest.approx(33 / 1e3)
    assert first.between == pytest.approx((110 - 0 - 105) / 1e3, abs=US)  # from .000 (.030 less its 30 ms) to .110
    assert first.factor == pytest.approx(35 / 11)
    assert second == SlicedPrompt(steps=2, work=pytest.approx(49 / 1e3), decoding=pytest.approx(20 / 1e3),
                                  between=pytest.approx((90 - (50 - 33) - 69) / 1e3, abs=US), factor=pytest.approx(34.5 / 10))


def test_a_span_starting_inside_the_model_continues_the_prompt_before():
    events = [step("01.030000", 30.0, 10.0, (0, 1), (0, 512)),
              step("01.062000", 30.0, 10.0, (0, 2), (512, 0))]  # sublayer 0 again, from row 512: the same prompt
    assert [p.steps for p in sliced_prompts(events)] == [2]


def test_a_prompt_is_not_taken_apart_where_a_step_decoding_part_was_not_timed():
    events = [step("01.030000", 30.0, 10.0, (0, 1), (0, 0)),
              step("01.062000", 30.0, None, (1, 60), (0, 0)),  # its rows had left: the rest in one step
              step("02.030000", 30.0, 10.0, (0, 60), (0, 0))]
    assert [p.steps for p in sliced_prompts(events)] == [1]
    assert sliced_prompts([]) == []
