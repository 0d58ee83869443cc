"""Layer-sliced prefill: a long prompt arriving while rows decode runs as large chunks, each through
a span of the layers a step (scheduling/prefill_budget.py says why). It changes no result: the
spans give the bits of the chunk in one pass, and the real tiny model driven step by step by the
DecodeLoop gives the same greedy tokens as whole-prompt prefill, while rows finish, move and are
cancelled around the chunk in flight. Then the budget's sizes, the plan's rules and the scheduler's."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine_service.faults import FaultInjector, FaultPlan
from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.presets import PRESETS
from engine_service.requests import Request, SamplingParams
from engine_service.runtime import loop as loop_module
from engine_service.runtime import model_runner as runner_module
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import DecodeLoop
from engine_service.runtime.model_runner import ModelRunner
from engine_service.scheduling.prefill_budget import (
    MAX_COMPLETION,
    MAX_SLICE_STALL_FACTOR,
    MAX_SLICE_TOKENS,
    MIN_SLICE_TOKENS,
    SLICE_BUCKET,
    SLICE_GAP_BOUND,
    SLICE_STALL_FACTOR,
    SPREAD_MIN,
    SPREAD_WINDOW,
    PrefillBudget,
    attention_share,
)
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import PromptSlice, Sequence
from engine_service.scheduling.step_plan import PlanError, StepPlan, SublayerSpan

CPU = torch.device("cpu")
LAYERS = 5  # 10 sublayers
MAX_BATCH = 4
MAX_CONTEXT = 256


def model() -> LlamaForCausalLM:
    m = LlamaForCausalLM(replace(PRESETS["tiny"], num_hidden_layers=LAYERS))
    m.init_random(7)
    m.pack_projections()
    m.setup_rope(MAX_CONTEXT, CPU)
    return m


def ids(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, 250, (n,), generator=g).tolist())


# -- the model: spans of sublayers --------------------------------------------------------------

@pytest.mark.parametrize("spans", [[(0, 10)], [(i, i + 1) for i in range(10)], [(0, 3), (3, 4), (4, 10)]])
def test_spans_of_sublayers_give_the_bits_of_the_chunk_in_one_pass(spans: list[tuple[int, int]]) -> None:
    m = model()
    first, second = torch.tensor(ids(1, 40)), torch.tensor(ids(2, 25))
    none = first[:0]
    want_cache, got_cache = (KVCache(m.config, 2, MAX_CONTEXT, torch.float32, CPU) for _ in range(2))
    for cache in (want_cache, got_cache):  # the row's first 40 positions, cached by a whole pass
        m.step(none, none, first, [PromptChunk(1, 0, 40)], cache, logits_of=[0])
    chunk = PromptChunk(1, 40, 25)  # at depth: its attention reads the cached positions too
    want = m.step(none, none, second, [chunk], want_cache, logits_of=[0])
    hidden = None
    for a, b in spans:
        hidden = m.prefill_sublayers(second, hidden, chunk, range(a, b), got_cache)
    assert hidden is not None
    assert torch.equal(m.chunk_logits(hidden), want)
    assert torch.equal(got_cache.k[:, 1, :, :65], want_cache.k[:, 1, :, :65])
    assert torch.equal(got_cache.v[:, 1, :, :65], want_cache.v[:, 1, :, :65])


@pytest.mark.parametrize("cuts", [
    [(0, 0), (0, 9), (2, 20), (3, 1), (7, 0), (9, 24), (10, 0)],  # parts of attentions and MLPs, a row alone
    [(0, 0), (0, 8), (0, 16), (1, 0), (1, 8), (1, 16), (10, 0)],  # a sublayer in three parts
])
@pytest.mark.parametrize("padded", [True, False])
def test_spans_with_parts_of_sublayers_rows_give_the_chunk_of_whole_sublayers(cuts: list[tuple[int, int]],
                                                                              padded: bool) -> None:
    prompt = ids(1, 65)
    long = seq("long", 65)
    long.request = replace(long.request, prompt_ids=prompt)
    out = []
    for spans in ([(0, 0), (10, 0)], cuts):
        runner = ModelRunner(model(), MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)
        runner.pad_sliced = padded  # the chunk's 25 rows run as 128, or as 25
        runner.forward(StepPlan.build([], [(long, PromptChunk(1, 0, 40))]))  # the row's first 40 positions
        chunk = PromptChunk(1, 40, 25)  # at depth: its attention reads the cached positions too
        for (first, first_row), (stop, stop_row) in zip(spans, spans[1:], strict=False):
            span = SublayerSpan(first, stop, stop == 2 * LAYERS, first_row, stop_row)
            logits = runner.forward(StepPlan.build([], [], sliced=(long, chunk, span))).sampled
        out.append((logits, runner.cache))
    # the same sums, but matmuls over other row counts: float32's rounding, not the same bits
    (want, want_cache), (got, got_cache) = out
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_cache.k[:, 1, :, :65], want_cache.k[:, 1, :, :65], rtol=0, atol=1e-6)
    torch.testing.assert_close(got_cache.v[:, 1, :, :65], want_cache.v[:, 1, :, :65], rtol=0, atol=1e-6)
    assert got_cache.k[:, 1, :, 40:65].abs().amin(dim=-1).gt(0).all(), "every layer's keys of the chunk written"


def test_a_span_is_its_whole_sublayers_in_one_run_and_each_part_alone() -> None:
    assert SublayerSpan(2, 6, False).pieces(64) == [(range(2, 6), 0, 64)]
    assert SublayerSpan(2, 6, False, 8, 16).pieces(64) == [(range(2, 3), 8, 64), (range(3, 6), 0, 64),
                                                            (range(6, 7), 0, 16)]
    assert SublayerSpan(2, 2, False, 8, 16).pieces(64) == [(range(2, 3), 8, 16)]
    assert SublayerSpan(2, 3, False, 8).pieces(64) == [(range(2, 3), 8, 64)]
    assert SublayerSpan(2, 4, False, 0, 1).pieces(64) == [(range(2, 4), 0, 64), (range(4, 5), 0, 1)]
    assert SublayerSpan(2, 3, False, 63, 5).pieces(64) == [(range(2, 3), 63, 64), (range(3, 4), 0, 5)]
    assert SublayerSpan(2, 6, False).resume == (6, 0) and SublayerSpan(2, 6, False, 8, 16).resume == (6, 16)


# -- the loop: the same greedy tokens -------------------------------------------------------------

class EverySlice:
    """A slicer (scheduler.Slicer) that slices every prompt longer than `over` beside decoding rows
    into chunks of at most `tokens`, `step` sublayers and `rows` rows a step (a step's span ends
    `step` sublayers and `rows` rows of the chunk on from where it starts): fixed sizes, so a test
    knows the steps."""

    def __init__(self, over: int, tokens: int, step: int, idle_too: bool = False, rows: int = 0) -> None:
        self.sublayers, self._over, self._tokens, self._step, self._rows = 2 * LAYERS, over, tokens, step, rows
        self._idle_too = idle_too  # keep to `step` sublayers a step when no row decodes too
        self.spans: list[tuple[int, int, int, int]] = []  # (start, length, first, stop) as planned
        self.parts: list[tuple[int, int, int, int]] = []  # (first, first row, stop, stop row) as planned
        self.asked: list[tuple[int, int, int]] = []  # slice_tokens' (decoding, position, remaining)

    def slice_tokens(self, decoding: int, position: int, remaining: int) -> int | None:
        self.asked.append((decoding, position, remaining))
        return min(remaining, self._tokens) if decoding and remaining > self._over else None

    def slice_stop(self, decoding: int, chunk: PromptChunk, first: int, first_row: int = 0) -> tuple[int, int]:
        if decoding or self._idle_too:
            at = (first + self._step) * chunk.length + first_row + self._rows
            stop, stop_row = divmod(min(at, self.sublayers * chunk.length), chunk.length)
        else:
            stop, stop_row = self.sublayers, 0
        self.spans.append((chunk.start, chunk.length, first, stop))
        self.parts.append((first, first_row, stop, stop_row))
        return stop, stop_row


def run(plan: list[tuple[int, str, tuple[int, ...], int]], slicer: EverySlice | None, budget: int = 4096,
        cancel: tuple[int, str] | None = None, prefill_budget: PrefillBudget | None = None) -> dict[str, tuple[int, ...]]:
    """Step the loop through `plan` ((step to submit at, id, prompt, max new tokens)), cancelling
    `cancel` ((step, id)) when given; greedy tokens by request id (a cancelled one's as far as it got)."""
    m = model()
    runner = ModelRunner(m, MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)
    scheduler = Scheduler(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, queue_capacity=16, queue_retry_seconds=0.5,
                          prefill_token_budget=budget, slicer=slicer)
    delivered: list[Delta] = []

    def fatal(exc: BaseException) -> None:
        raise AssertionError(f"on_fatal: {exc!r}")

    loop = DecodeLoop(runner, scheduler, FaultInjector(FaultPlan()), frozenset(), delivered.extend, fatal,
                      prefill_budget=prefill_budget)
    seqs: dict[str, Sequence] = {}
    pending = sorted(plan, key=lambda p: p[0])
    step = 0
    while pending or scheduler.rows or scheduler.waiting_count():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, max_new = pending.pop(0)
            seqs[request_id] = Sequence(Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new,
                                                sampling=SamplingParams(), stop_token_ids=frozenset(),
                                                ignore_eos=True, deadline=None), sink=None)
            scheduler.submit(seqs[request_id])
        if cancel is not None and cancel[0] == step:
            seqs[cancel[1]].cancelled = True
        loop.step()
        step += 1
    assert all(e.error is None for e in delivered)
    return {r: tuple(s.generated) for r, s in seqs.items()}


TRAFFIC = [
    (0, "a", ids(3, 12), 40),
    (0, "b", ids(4, 9), 6),  # finishes while the long prompt is in flight: rows move around it
    (2, "long", ids(5, 150), 8),
    (3, "short", ids(6, 20), 10),  # waits behind the chunk in flight, then prefills plainly
    (4, "second-long", ids(7, 90), 5),
]


def test_sliced_prefill_gives_the_tokens_of_whole_prompt_prefill_while_rows_finish_and_move() -> None:
    want = run(TRAFFIC, None)
    slicer = EverySlice(over=32, tokens=64, step=3)
    got = run(TRAFFIC, slicer)
    assert got == want
    starts = {(s, n) for s, n, _, _ in slicer.spans}
    assert {(0, 64), (64, 64)} <= starts, "the long prompt ran as two sliced chunks"
    assert (128, 22) not in starts, "and its last 22 tokens, within one plain chunk, as a plain chunk"
    assert [s for s in slicer.spans if s[:2] == (0, 64)] == [(0, 64, 0, 3), (0, 64, 3, 6), (0, 64, 6, 9), (0, 64, 9, 10)]


def test_parts_of_sublayers_rows_give_the_tokens_of_whole_prompt_prefill() -> None:
    want = run(TRAFFIC, None)
    slicer = EverySlice(over=32, tokens=64, step=1, rows=40)
    assert run(TRAFFIC, slicer) == want
    assert (0, 0, 1, 40) in slicer.parts and (1, 40, 3, 16) in slicer.parts, "spans that end and begin in a sublayer"


def test_a_chunk_cancelled_in_flight_leaves_the_others_untouched() -> None:
    plan = [p for p in TRAFFIC if p[1] != "second-long"]
    want = run(plan, None)
    slicer = EverySlice(over=32, tokens=64, step=1)
    got = run(plan, slicer, cancel=(4, "long"))  # in flight: submitted at 2, ten steps a chunk
    assert got["long"] == ()
    assert {r: t for r, t in got.items() if r != "long"} == {r: t for r, t in want.items() if r != "long"}
    assert any(first for _, _, first, _ in slicer.spans), "the cancelled chunk was in flight"


def test_a_chunk_in_flight_goes_on_through_steps_where_nothing_produces_a_token() -> None:
    plan = [(0, "a", ids(3, 12), 3), (1, "long", ids(5, 150), 6)]  # a ends while long is in flight
    want = run(plan, None)
    slicer = EverySlice(over=32, tokens=200, step=1, idle_too=True)
    assert run(plan, slicer) == want
    assert len([s for s in slicer.spans if s[:2] == (0, 150)]) == 10, "one sublayer a step, a's rows gone or not"


class RecordingBudget(PrefillBudget):
    """The adaptive budget of 10 sublayers, recording the sliced steps the loop tells it of."""

    def __init__(self) -> None:
        super().__init__(None, 4096, sublayers=2 * LAYERS)
        self.sliced: list[tuple[int, PromptChunk, int, int, float, float | None]] = []

    def observe_slice(self, decoding: int, chunk: PromptChunk, span: SublayerSpan, seconds: float,
                      decode_seconds: float | None = None) -> None:
        self.sliced.append((decoding, chunk, span.first, span.stop, seconds, decode_seconds))
        super().observe_slice(decoding, chunk, span, seconds, decode_seconds)


class HalfClock:
    """Stands in for the runner's `time` module: perf_counter advances half a step a call, so the
    decoding rows' part of a sliced step, which the runner times, takes half of STEP_SECONDS."""

    def __init__(self, step: float) -> None:
        self.calls, self.step = 0, step

    def perf_counter(self) -> float:
        self.calls += 1
        return self.calls * self.step / 2


def test_the_loop_tells_the_budget_each_sliced_steps_span_and_time_and_logs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_loop_mutants import STEP_SECONDS, Clock, Recorder

    monkeypatch.setattr(loop_module, "time", Clock())
    monkeypatch.setattr(runner_module, "time", HalfClock(STEP_SECONDS))
    log = Recorder()
    monkeypatch.setattr(loop_module, "log", log)
    budget = RecordingBudget()
    run([(0, "a", ids(3, 12), 12), (3, "long", ids(5, 80), 2)], EverySlice(over=32, tokens=64, step=4),
        prefill_budget=budget)  # a's decode steps timed first: the sliced steps are counted against them
    chunk = PromptChunk(1, 0, 64)
    assert [call[:4] for call in budget.sliced] == [(1, chunk, 0, 4), (1, chunk, 4, 8), (1, chunk, 8, 10)]
    assert [x for call in budget.sliced for x in call[4:]] == pytest.approx([STEP_SECONDS, STEP_SECONDS / 2] * 3)
    events = [(level, fields) for level, event, fields in log.calls if event == "sliced_prefill_step"]
    assert [f["sublayers"] for _, f in events] == [[0, 4], [4, 8], [8, 10]]
    level, first = events[0]
    assert level == "debug" and {k: first[k] for k in ("decoding", "tokens", "position", "sublayers", "ms",
                                                       "decode_part_ms")} == {
        "decoding": 1, "tokens": 64, "position": 0, "sublayers": [0, 4], "ms": 12.3, "decode_part_ms": 6.2}
    # the sliced steps' halves beyond their decode parts: 4 sublayers of 64 tokens, a weight of 25.6
    # idle tokens (attention_share 0.5, no parity), at 1 / 25.6 of a decode part each; an idle
    # token took 1 / 12 of a decode step (a's 12-token prefill took a step). So a slice cost of
    # 12 / 25.6 = 0.46875, averaged in: 1 + 0.3 x (0.46875 - 1) = 0.840625, then 0.7290625; the
    # completing step (sublayers 8..10, a weight of 12.8) teaches the completion instead: its half
    # beyond its decode part, less 12.8 x 0.7290625 / 12 of it, over 64 tokens, a thousand of them
    assert [f["slice_cost"] for _, f in events] == pytest.approx([0.841, 0.729, 0.729], abs=6e-4)
    completion = (1 - 12.8 * 0.7290625 / 12) / 64 * 1000
    assert [f["completion_per_1k"] for _, f in events] == [None, None, pytest.approx(completion, abs=6e-4)]
    assert [f["rows"] for _, f in events] == [[0, 0]] * 3
    assert events[-1][1]["decode_ms"] == {1: 12.34} and set(events[-1][1]) == {
        "decoding", "tokens", "position", "sublayers", "rows", "ms", "decode_part_ms",
        *budget.describe()}  # the estimates of the time


def test_the_sliced_steps_log_gives_their_decoding_part_in_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_loop_mutants import Clock, Recorder

    monkeypatch.setattr(loop_module, "time", Clock())
    monkeypatch.setattr(runner_module, "time", HalfClock(0.2468))  # decoding parts of 0.1234 s
    log = Recorder()
    monkeypatch.setattr(loop_module, "log", log)
    run([(0, "a", ids(3, 12), 12), (3, "long", ids(5, 80), 2)], EverySlice(over=32, tokens=64, step=4),
        prefill_budget=RecordingBudget())
    parts = [f["decode_part_ms"] for _, event, f in log.calls if event == "sliced_prefill_step"]
    assert parts == [123.4] * 3


def test_budget_chunks_and_slicing_change_no_token_together() -> None:
    want = run(TRAFFIC, None)
    assert run(TRAFFIC, EverySlice(over=32, tokens=40, step=4), budget=24) == want


# -- the budget's sizes -------------------------------------------------------------------------

def measured(sublayers: int = 60, decode: float = 0.03125, token_idle: float = 0.0005, **kw: float) -> PrefillBudget:
    """A budget that has timed a decode-only step of 8 rows and an idle prefill of 1,000 tokens."""
    budget = PrefillBudget(None, 4096, sublayers=sublayers, **kw)  # type: ignore[arg-type]
    budget.observe(8, [], decode)
    budget.observe(0, [PromptChunk(9, 0, 1000)], token_idle * 1000 * (1 + 499.5 / budget.parity))
    return budget


SHARE = (SLICE_STALL_FACTOR - 1) * 0.03125 / 0.0005  # 125 idle tokens through every layer a step, beside 8 rows


def test_a_slice_is_the_prompt_up_to_the_largest_chunk_and_a_rest_too_short_to_slice_joins_it() -> None:
    budget = measured(decode=0.005)  # a share of 20 idle tokens: a step runs a part of a sublayer's rows
    assert SLICE_BUCKET == 128 and MIN_SLICE_TOKENS == 512
    assert budget.slice_tokens(8, 0, 100000) == MAX_SLICE_TOKENS
    assert budget.slice_tokens(8, 0, 1100) == 1100, "the whole prompt"
    assert budget.slice_tokens(8, 3000, 1100) == 1100, "however deep"
    assert budget.slice_tokens(8, 0, MAX_SLICE_TOKENS + 513) == MAX_SLICE_TOKENS
    assert budget.slice_tokens(8, 0, MAX_SLICE_TOKENS + 512) == MAX_SLICE_TOKENS + 512, "no rest that would go unsliced"
    assert budget.slice_tokens(8, 0, MIN_SLICE_TOKENS) is None, "a short prompt: a step or two of plain chunks"
    assert budget.slice_tokens(8, 0, MIN_SLICE_TOKENS + 1) == MIN_SLICE_TOKENS + 1
    slow = measured(decode=0.25)  # decode steps so long that a plain chunk passes MIN_SLICE_TOKENS
    plain = slow.tokens(8, 0)
    assert plain > MIN_SLICE_TOKENS
    assert slow.slice_tokens(8, 0, plain) is None, "a prompt that fits one plain chunk"
    assert slow.slice_tokens(8, 0, plain + 1) == plain + 1


def test_a_step_runs_the_sublayers_that_fit_its_share_then_the_whole_buckets_of_rows_that_fit() -> None:
    budget = measured()  # attention_share 0.5, parity inf: every sublayer of n tokens weighs n / 60
    # 2,000 tokens, 33.3 a sublayer: 3 (100 of 125), then 1,408 rows of the fourth (23.5; 1,536: 25.6)
    assert budget.slice_stop(8, PromptChunk(9, 0, 2000), 0) == (3, 1408)
    # from there: the fourth's last 592 rows (9.9), three whole (100), 896 rows of the eighth (14.9; 1,024: 17.1)
    assert budget.slice_stop(8, PromptChunk(9, 0, 2000), 3, 1408) == (7, 896), "the rest of the fourth first"
    assert budget.slice_stop(8, PromptChunk(9, 0, 400), 0) == (18, 256)  # 6.67 each: 120, then 4.27 of 5
    assert budget.slice_stop(8, PromptChunk(9, 0, 400), 7) == (25, 256)
    assert budget.slice_stop(8, PromptChunk(9, 0, 400), 55) == (60, 0), "no further than the last sublayer"
    assert budget.slice_stop(8, PromptChunk(9, 0, 100000), 3) == (3, 7424), "rows of one sublayer: 123.7 of 125"
    assert budget.slice_stop(0, PromptChunk(9, 0, 2000), 3) == (60, 0), "no row decoding: every sublayer left at once"
    exact_fit = PrefillBudget(None, 4096, sublayers=64)  # binary-exact: a share of 128, 1,024 tokens 16 a sublayer
    exact_fit.observe(8, [], 2**-5)
    exact_fit.observe(0, [PromptChunk(9, 0, 1024)], 0.5)
    assert exact_fit.slice_stop(8, PromptChunk(9, 0, 1024), 0) == (8, 0), "whole sublayers that fill it exactly"
    assert exact_fit.slice_stop(8, PromptChunk(9, 0, 1024), 0, 128) == (8, 128), "and a part's rows too"
    assert exact_fit.slice_stop(8, PromptChunk(9, 0, 1024), 56) == (64, 0), "no completion learned: none counted"
    tiny = measured(decode=0.0002)  # a share of 0.8: 48 rows, less than a bucket
    assert tiny.slice_stop(8, PromptChunk(9, 0, 2000), 3, 256) == (3, 384), "at least a bucket"
    assert tiny.slice_stop(8, PromptChunk(9, 0, 2000), 3, 1920) == (4, 0), "a rest of a bucket or less whole"
    assert tiny.slice_stop(8, PromptChunk(9, 0, 100), 59) == (60, 0)


def attention(tokens: int, start: int) -> float:
    """An attention sublayer's weight in `measured(parity=1000.0, attention_share=0.25)`."""
    return tokens * (0.25 + (start + (tokens - 1) / 2) / 1000) / 30


def test_attention_weighs_a_part_of_a_sublayer_at_its_rows_depth() -> None:
    budget = measured(parity=1000.0, attention_share=0.25)
    # 500 tokens at 3,000: an attention weighs 500 x (0.25 + 3,249.5 / 1,000) / 30 = 58.3, an MLP 12.5
    chunk = PromptChunk(9, 3000, 500)
    assert attention(500, 3000) == pytest.approx(58.3, abs=0.05)
    # 58.3 + 12.5, and of the next attention 384 rows (44.1; all of it would pass 125)
    assert attention(384, 3000) <= SHARE - attention(500, 3000) - 12.5 < attention(500, 3000)
    assert budget.slice_stop(8, chunk, 0) == (2, 384)
    # from row 384 of an attention: its last 116 rows weigh their depth, 3,384 to 3,499 (14.3)
    rest = attention(116, 3384)
    assert budget.slice_stop(8, chunk, 2, 384) == (6, 128)  # 14.3 + 12.5 + 58.3 + 12.5, then 128 rows (14.1)
    assert rest + 12.5 + attention(500, 3000) + 12.5 + attention(128, 3000) <= SHARE
    assert rest + 12.5 + attention(500, 3000) + 12.5 + attention(256, 3000) > SHARE
    assert budget.slice_stop(8, chunk, 1) == (4, 256)  # 12.5 + 58.3 + 12.5, then 256 rows (28.8; 384: 44.1)
    narrow = measured(decode=0.0072, parity=1000.0, attention_share=0.25)  # a share of 28.8
    assert attention(128, 3128) < 28.8 < attention(256, 3128)  # an attention's rows from 128 on, at their depth
    assert narrow.slice_stop(8, chunk, 2, 128) == (2, 256)


def test_no_slice_without_sublayers_a_fixed_budget_decoding_rows_or_measurements() -> None:
    assert measured(sublayers=0).slice_tokens(8, 0, 5000) is None
    fixed = PrefillBudget(96, 4096, sublayers=60)
    fixed.observe(8, [], 0.025)
    fixed.observe(0, [PromptChunk(9, 0, 1000)], 0.5)
    assert fixed.slice_tokens(8, 0, 5000) is None, "--max-prefill-tokens N: plain chunks of N"
    assert measured().slice_tokens(0, 0, 5000) is None, "nothing decoding: the whole prompt at once"
    unmeasured = PrefillBudget(None, 4096, sublayers=60)
    assert unmeasured.slice_tokens(8, 0, 5000) is None
    assert unmeasured.slice_stop(8, PromptChunk(9, 0, 100), 0) == (60, 0)
    decode_only = PrefillBudget(None, 4096, sublayers=60)
    decode_only.observe(8, [], 0.025)
    assert decode_only.slice_tokens(8, 0, 5000) is None, "no idle prefill timed yet"


def test_a_sliced_steps_time_teaches_the_slice_cost() -> None:
    budget = measured()
    chunk = PromptChunk(9, 0, 400)
    assert budget.slice_stop(8, chunk, 0) == (18, 256)
    # 6 sublayers of 400 tokens in 0.03125 + 0.04 s: twice idle prefill's share of them (0.02 s)
    for _ in range(30):
        budget.observe_slice(8, chunk, SublayerSpan(10, 16, False), 0.03125 + 0.04)
    assert budget.describe()["slice_cost"] == pytest.approx(2.0, rel=1e-3)
    assert budget.slice_stop(8, chunk, 0) == (9, 128)  # a share of 62.5: 9 sublayers (60), 128 rows (2.13)
    for _ in range(30):  # far cheaper, or dearer, than anything plausible: held within the bounds
        budget.observe_slice(8, chunk, SublayerSpan(0, 1, False), 0.03125)
    assert budget.describe()["slice_cost"] == pytest.approx(0.25, rel=1e-3)
    for _ in range(30):
        budget.observe_slice(8, chunk, SublayerSpan(0, 1, False), 10.0)
    assert budget.describe()["slice_cost"] == pytest.approx(4.0, rel=1e-3)
    unmeasured = PrefillBudget(None, 4096, sublayers=60)
    unmeasured.observe_slice(8, chunk, SublayerSpan(0, 1, False), 10.0)
    assert unmeasured.describe()["slice_cost"] == 1.0, "nothing to count the step against yet"
    assert "slice_cost" not in PrefillBudget(None, 4096).describe(), "no slicing, no slice cost"


def test_a_step_of_parts_of_sublayers_teaches_the_cost_of_its_rows() -> None:
    budget = measured()  # 400 tokens: 6.67 a sublayer, 0.0005 s each at an idle prefill's rate
    chunk = PromptChunk(9, 0, 400)
    # the last 144 rows of sublayer 10, sublayers 11 to 15, 256 rows of 16: 2.4 + 33.3 + 4.27 = 40
    # idle tokens, 0.02 s at an idle prefill's cost; twice that: a cost of 2
    for _ in range(30):
        budget.observe_slice(8, chunk, SublayerSpan(10, 16, False, 256, 256), 0.03125 + 0.04)
    assert budget.describe()["slice_cost"] == pytest.approx(2.0, rel=1e-3)
    deep = measured(parity=1000.0, attention_share=0.25)
    at_depth = PromptChunk(9, 3000, 500)
    weight = attention(116, 3384) + attention(128, 3000)  # the rows of two attentions, at their depths
    for _ in range(30):
        deep.observe_slice(8, at_depth, SublayerSpan(2, 4, False, 384, 128), 0.03125 + 2 * (weight + 12.5) * 0.0005)
    assert deep.describe()["slice_cost"] == pytest.approx(2.0, rel=1e-3)


def test_the_completing_steps_time_teaches_the_completion_and_its_span_leaves_room_for_it() -> None:
    budget = measured()  # a share of 125 idle tokens; 400 tokens: 6.67 a sublayer, 0.0005 s each
    chunk = PromptChunk(9, 0, 400)
    assert budget.slice_stop(8, chunk, 45) == (60, 0) and budget.describe()["completion_per_1k"] is None
    # the step that ran sublayers 58 and 59 took them (2 x 6.67 x 0.0005 s) and half a decode step
    # more (the LM head, the prefix cache's copy, the first token): 0.5 / 400 decode steps a token
    budget.observe_slice(8, chunk, SublayerSpan(58, 60, True), 0.03125 + 2 * 400 / 60 * 0.0005 + 0.03125 / 2)
    assert budget.describe()["completion_per_1k"] == 1.25
    assert budget.describe()["slice_cost"] == 1.0, "not the sublayers' rate: that step is no measure of it"
    # its weight, 0.00125 x 400 x 0.03125 / 0.0005 = 31.25, comes out of the completing span: 15
    # sublayers (100) would pass the share with it; 14 (93.3) and the last one's rows but its last bucket
    assert budget.slice_stop(8, chunk, 45) == (59, 384)
    assert budget.slice_stop(8, chunk, 59, 384) == (60, 0), "its last rows and the completion"
    assert budget.slice_stop(8, chunk, 50) == (60, 0), "10 sublayers (66.7) and the completion fit"
    assert budget.slice_stop(8, chunk, 41) == (59, 256), "a span that does not complete the prompt: as before"
    # 800 tokens: 13.3 a sublayer and a completion of 62.5: from 52, 7 sublayers and 6 buckets of the last
    assert budget.slice_stop(8, PromptChunk(9, 0, 800), 52) == (59, 768), "the completion counts the prompt's tokens"
    assert budget.slice_stop(8, PromptChunk(9, 0, 800), 56) == (60, 0)
    budget.observe_slice(8, chunk, SublayerSpan(58, 60, True), 0.0)  # quicker than its decode step: no completion
    assert budget.describe()["completion_per_1k"] == 0.875  # 1.25 - 0.3 x 1.25
    budget.observe_slice(8, chunk, SublayerSpan(58, 60, True), 0.0)
    shown = budget.describe()["completion_per_1k"]
    assert shown == pytest.approx(0.6125, abs=1e-3) and shown != 0.6125, "shown to three places"
    for _ in range(40):  # dearer than anything plausible: held at MAX_COMPLETION
        budget.observe_slice(8, chunk, SublayerSpan(59, 60, True), 100.0)
    assert budget.describe()["completion_per_1k"] == pytest.approx(MAX_COMPLETION * 1000)
    assert budget.slice_stop(8, chunk, 50) == (59, 384), "the completion alone passes the share"
    assert budget.slice_stop(8, chunk, 59, 384) == (60, 0), "and the last rows, with it, at least a bucket"
    assert budget.slice_stop(0, chunk, 50) == (60, 0), "no row decoding: every sublayer left at once"


def test_a_machine_that_slows_as_a_whole_keeps_a_steps_span() -> None:
    budget = measured()  # a share of 125 idle tokens: 18 sublayers of 400 tokens (6.67 each) and 256 rows
    chunk = PromptChunk(9, 0, 400)
    for _ in range(30):  # sliced steps at exactly an idle prefill's cost: 6 sublayers, 0.02 s beyond the decode step
        budget.observe_slice(8, chunk, SublayerSpan(10, 16, False), 0.03125 + 0.02)
    assert budget.slice_stop(8, chunk, 0) == (18, 256)
    for _ in range(60):  # then every decode step takes twice as long (so will the sliced work), and no
        budget.observe(8, [], 0.0625)  # idle prefill comes to say so: its time is stale
    # the rate is learned against the decode step: still 2 decode steps' worth, now 0.125 s; counted
    # against the stale idle prefill's time, 37 sublayers would have taken 0.25 s
    assert budget.slice_stop(8, chunk, 0) == (18, 256)
    assert budget.describe()["slice_cost"] == pytest.approx(1.0), "as of the last sliced step"


def test_a_sliced_steps_chunk_is_counted_against_its_own_decode_part_where_the_runner_timed_it() -> None:
    # the machine slowed since the decode-only steps were timed (0.03125 s): this prompt's steps'
    # decode parts take 0.04 s, and 6 sublayers of 400 tokens (a weight of 40) 0.025 s beyond them
    chunk, span = PromptChunk(9, 0, 400), SublayerSpan(10, 16, False)
    timed, untimed = measured(), measured()
    for _ in range(30):
        timed.observe_slice(8, chunk, span, 0.04 + 0.025, decode_seconds=0.04)
        untimed.observe_slice(8, chunk, span, 0.04 + 0.025)
    # 0.025 / 40 / 0.04 = 1/64 of a decode step a unit of weight, against an idle token's 0.016: a
    # share of 2 x 64 = 128, 19 sublayers (126.7) and no bucket of 128 rows (2.13) of the twentieth
    assert timed.describe()["slice_cost"] == pytest.approx(0.9765625, abs=6e-4)
    assert timed.slice_stop(8, chunk, 0) == (19, 0)
    # counted against the estimate, the decode part's extra 0.00875 s was the chunk's: 0.02725 s
    # a unit over the estimate's 0.03125 x 40 decode steps, a share of 74.1, 11 sublayers
    assert untimed.slice_stop(8, chunk, 0) == (11, 0)


def test_a_rate_learned_beside_some_rows_is_counted_against_their_decode_step_beside_others() -> None:
    budget = measured()  # decode steps of 8 rows: 0.03125 s
    chunk = PromptChunk(9, 0, 400)
    for _ in range(30):  # sliced at an idle prefill's cost beside 8 rows
        budget.observe_slice(8, chunk, SublayerSpan(10, 16, False), 0.03125 + 0.02)
    for _ in range(60):
        budget.observe(2, [], 0.03125 / 4)  # 2 rows decode in a quarter of the time
    # the share beside 2 rows is 2 of their decode steps: a quarter of the 8 rows' (31.25): 4 sublayers, 256 rows
    assert budget.slice_stop(2, chunk, 0) == (4, 256)
    assert budget.slice_stop(8, chunk, 0) == (18, 256)


def test_the_stall_factor_is_as_large_as_keeps_the_recent_slowest_steps_within_the_gap_bound() -> None:
    assert (SLICE_STALL_FACTOR, SLICE_GAP_BOUND, MAX_SLICE_STALL_FACTOR) == (3.0, 3.6, 4.0)
    assert (SPREAD_MIN, SPREAD_WINDOW) == (32, 128)
    budget = measured()  # decode-only steps of 8 rows: 0.03125 s; 400 tokens: 6.67 a sublayer
    chunk, decode = PromptChunk(9, 0, 400), 0.03125

    def steps(n: int, ratio: float) -> None:
        """n sliced steps, each `ratio` times the target it was sized for; at 1, its sublayers at an
        idle prefill's cost (a weight of (factor - 1) x 62.5: 18 sublayers and 300 rows at 3, 24 and 150
        at 3.6), so the slice cost stays 1"""
        for _ in range(n):
            factor = budget.describe()["slice_factor"]
            span = SublayerSpan(0, 18, False, 0, 300) if factor == 3.0 else SublayerSpan(0, 24, False, 0, 150)
            budget.observe_slice(8, chunk, span, ratio * factor * decode)  # type: ignore[operator]

    assert budget.describe()["slice_factor"] == SLICE_STALL_FACTOR
    assert budget.slice_stop(8, chunk, 0) == (18, 256), "a share of 125 idle tokens"
    steps(SPREAD_MIN - 1, 1.0)
    assert budget.describe()["slice_factor"] == SLICE_STALL_FACTOR, "too few steps timed to say how still they run"
    steps(1, 1.0)  # steps take their target: the slowest may be 3.6 decode steps, 20% more
    assert budget.describe()["slice_factor"] == pytest.approx(3.6)
    assert budget.describe()["slice_cost"] == pytest.approx(1.0)
    assert budget.slice_stop(8, chunk, 0) == (24, 128), "a share of 162.5: 24 sublayers and a bucket"
    steps(40, 1.0)
    assert budget.describe()["slice_factor"] == pytest.approx(3.6), "steps sized for it that take it hold it"
    steps(1, 2.0)
    assert budget.describe()["slice_factor"] == pytest.approx(3.6), "one stray slow step is left out"
    steps(1, 1.5)  # a second: the streams would wait 5.4 decode steps at 3.6, so back to the least
    assert budget.describe()["slice_factor"] == SLICE_STALL_FACTOR
    steps(SPREAD_WINDOW - 2, 1.0)
    assert budget.describe()["slice_factor"] == SLICE_STALL_FACTOR, "both slow steps still in the window"
    steps(1, 1.0)
    assert budget.describe()["slice_factor"] == pytest.approx(3.6), "the first has left it"
    steps(SPREAD_WINDOW, 0.8)  # steps quicker than their targets: the factor would be 4.5
    assert budget.describe()["slice_factor"] == MAX_SLICE_STALL_FACTOR


def test_the_stall_factor_counts_steps_in_their_decoding_parts_median() -> None:
    budget = measured()  # the decode-only estimate: 0.03125 s, but this prompt's decoding parts take 0.04
    chunk, span = PromptChunk(9, 0, 400), SublayerSpan(10, 16, False)
    budget.observe_slice(8, chunk, span, 3 * 0.04, decode_seconds=1.0)  # one decoding part stalled: the median leaves it
    for _ in range(SPREAD_MIN - 1):
        budget.observe_slice(8, chunk, span, 3 * 0.04, decode_seconds=0.04)
    assert budget.describe()["slice_factor"] == pytest.approx(SLICE_GAP_BOUND)
    untimed = measured()  # no decoding part timed (off a CPU): the decode-only estimate is the unit
    for _ in range(SPREAD_MIN):
        untimed.observe_slice(8, chunk, span, 3 * 0.03125 * 1.1)
    assert untimed.describe()["slice_factor"] == 3.273, "3.6 / 1.1, shown to three places"
    assert "slice_factor" not in PrefillBudget(None, 4096).describe(), "no slicing, no factor"


def test_attention_share_is_the_attention_projections_part_of_a_layers_matmuls() -> None:
    assert attention_share(PRESETS["tiny"]) == pytest.approx((64 * 128 + 64 * 64) / (64 * 128 + 64 * 64 + 3 * 64 * 128))
    smollm2 = replace(PRESETS["tiny"], hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536)
    assert attention_share(smollm2) == pytest.approx(0.25, abs=0.002)


# -- the plan's rules and the scheduler's --------------------------------------------------------

def seq(request_id: str, prompt_len: int = 100) -> Sequence:
    return Sequence(Request(request_id=request_id, prompt_ids=tuple(range(1, prompt_len + 1)), max_new_tokens=10,
                            sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None),
                    sink=None)


def test_a_sliced_chunk_completes_its_prompt_only_through_its_last_layer() -> None:
    a, long = seq("a"), seq("long", 100)
    mid = StepPlan.build([a], [], sliced=(long, PromptChunk(1, 36, 64), SublayerSpan(2, 4, False)))
    assert mid.sliced is mid.prefills[0] and not mid.prefills[0].done and not mid.prefills[0].completes
    assert mid.sampled_rows == 1 and mid.prefills[0].logits is None
    end = StepPlan.build([a], [], sliced=(long, PromptChunk(1, 36, 64), SublayerSpan(4, 5, True)))
    assert end.prefills[0].completes and end.prefills[0].logits == slice(1, 2) and end.sampled_rows == 2
    early = StepPlan.build([a], [], sliced=(long, PromptChunk(1, 0, 36), SublayerSpan(4, 5, True)))
    assert early.prefills[0].done and not early.prefills[0].completes
    assert StepPlan.build([a], []).sliced is None


def test_the_plan_refuses_a_sliced_chunk_beside_others_an_empty_span_or_an_echoed_prompt() -> None:
    a, b, long = seq("a"), seq("b", 8), seq("long")
    with pytest.raises(PlanError, match="long: a layer-sliced chunk beside 1 other chunks"):
        StepPlan.build([a], [(b, PromptChunk(1, 0, 8))], sliced=(long, PromptChunk(2, 0, 50), SublayerSpan(0, 1, False)))
    for span in (SublayerSpan(3, 3, False), SublayerSpan(-1, 2, False), SublayerSpan(3, 3, False, 20, 20),
                 SublayerSpan(3, 3, False, 20, 10), SublayerSpan(3, 2, False, 0, 40), SublayerSpan(3, 4, False, 50),
                 SublayerSpan(3, 4, False, -1), SublayerSpan(3, 4, False, 0, 50), SublayerSpan(3, 4, False, 0, -1),
                 SublayerSpan(3, 4, True, 0, 10)):
        with pytest.raises(PlanError, match=f"long: sublayers from {span.first} row {span.first_row} to {span.stop} "
                                            f"row {span.stop_row} of a 50-token chunk"):
            StepPlan.build([a], [], sliced=(long, PromptChunk(1, 0, 50), span))
    for span in (SublayerSpan(3, 3, False, 20, 21), SublayerSpan(3, 4, False, 49, 49), SublayerSpan(0, 1, False, 0, 0),
                 SublayerSpan(3, 3, False, 0, 1)):
        assert StepPlan.build([a], [], sliced=(long, PromptChunk(1, 0, 50), span)).sliced is not None
    echo = Sequence(replace(long.request, echo_prompt_logprobs=True), sink=None)
    with pytest.raises(PlanError, match="long: a layer-sliced chunk of a prompt whose log-probabilities are echoed"):
        StepPlan.build([a], [], sliced=(echo, PromptChunk(1, 0, 50), SublayerSpan(0, 1, False)))


def test_the_scheduler_plans_the_chunk_in_flight_first_and_alone_and_moves_its_row_whole() -> None:
    slicer = EverySlice(over=32, tokens=64, step=3)
    sched = Scheduler(max_batch=4, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                      prefill_token_budget=16, slicer=slicer)
    a, long, short = seq("a", 8), seq("long", 100), seq("short", 8)
    for s in (a, long, short):
        sched.submit(s)
    sched.admit()
    started: list[str] = []

    def start(s: Sequence, row: int) -> None:
        started.append(s.request_id)

    first = sched.plan(start)  # nothing decodes: plain chunks within the idle budget
    assert first.sliced is None and [p.seq.request_id for p in first.prefills] == ["a", "long", "short"]
    a.cache_len, long.cache_len, short.cache_len = 8, 16, 0  # long: a 16-token prefix reused
    sched.promote([a], lambda *args: None)
    slicer.asked.clear()
    prefilling: list[bool] = []  # what the speculator is told: a sliced chunk is a prompt chunk too
    plan = sched.plan(start, lambda decoding, chunk: prefilling.append(chunk))  # type: ignore[func-returns-value]
    assert slicer.asked == [(1, 16, 84)] and prefilling == [True]
    assert plan.sliced is not None and plan.prefills == (plan.sliced,)
    assert (plan.sliced.chunk, plan.sliced.sublayers) == (PromptChunk(1, 16, 64), SublayerSpan(0, 3, False))
    assert long.slice == PromptSlice(64)
    long.slice = PromptSlice(64, 9)
    again = sched.plan(start)
    assert again.sliced is not None and again.sliced.sublayers == SublayerSpan(9, 10, True)
    long.slice = PromptSlice(64, 4, 40)
    slicer.parts.clear()
    part = sched.plan(start)
    assert slicer.parts == [(4, 40, 7, 40)] and part.sliced is not None
    assert part.sliced.sublayers == SublayerSpan(4, 7, False, 40, 40)
    moves: list[tuple[int, int, int]] = []
    sched.remove_rows([0], lambda src, dst, n: moves.append((src, dst, n)))  # "a" leaves: the last row moves up
    assert moves == [(2, 0, 0)]  # "short", nothing cached yet
    assert [s.request_id for s in sched.rows] == ["short", "long"]
    moves.clear()
    sched.remove_rows([0], lambda src, dst, n: moves.append((src, dst, n)))
    assert moves == [(1, 0, 80)], "the chunk in flight moves with its row: its keys and values in some layers"
    assert long.kv_len == 80 and long.cache_len == 16


# -- the runner: padding, the warm-up, and a span with nothing before it -------------------------

def test_the_runner_pads_a_sliced_chunk_to_whole_buckets_within_the_context_and_warms_without_the_cache() -> None:
    runner = ModelRunner(model(), MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)
    assert runner._padded(PromptChunk(1, 0, 64)) == PromptChunk(1, 0, 128)
    assert runner._padded(PromptChunk(1, 0, 128)) == PromptChunk(1, 0, 128)
    assert runner._padded(PromptChunk(1, 64, 129)) == PromptChunk(1, 64, 192)
    assert runner._padded(PromptChunk(1, 200, 40)) == PromptChunk(1, 200, 56), "no further than the context"
    wide = ModelRunner(model(), 1, 2 * MIN_SLICE_TOKENS, CPU, torch.float32)  # row counts 128, 256, ... 1,024
    wide.cache.k.normal_()
    before = wide.cache.k.clone()
    wide.warm_sliced_prefill()
    assert torch.equal(wide.cache.k, before), "the warm-up runs the projections alone"


def test_the_warm_up_keeps_the_padding_where_a_new_row_count_costs_the_threshold_or_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for threshold, padded in ((math.inf, False), (-math.inf, True)):
        monkeypatch.setattr(runner_module, "PAD_UNLESS_NEW_COUNT_MS", threshold)
        runner = ModelRunner(model(), MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)
        measured_ms = runner.warm_sliced_prefill()
        assert measured_ms is not None and math.isfinite(measured_ms) and runner.pad_sliced is padded
        assert runner._padded(PromptChunk(1, 64, 129)) == PromptChunk(1, 64, 192 if padded else 129)
    # three row counts never seen, each run twice: the least of first minus second, in ms
    runner = ModelRunner(model(), MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)
    ticks = iter([0.0, 0.010, 0.012, 1.0, 1.004, 1.007, 2.0, 2.009, 2.011])  # excess 8, 1, 7 ms
    monkeypatch.setattr(runner_module, "time", type("Ticks", (), {"perf_counter": staticmethod(lambda: next(ticks))}))
    assert runner._new_count_ms(runner.model.model.layers[0]) == pytest.approx(1.0)
    monkeypatch.setattr(runner_module, "PAD_UNLESS_NEW_COUNT_MS", 1.0)
    ticks = iter([0.0, 0.010, 0.012, 1.0, 1.004, 1.007, 2.0, 2.009, 2.011])
    runner.warm_sliced_prefill()
    assert runner.pad_sliced, "a first call 1 ms dearer: at the threshold, padded"


def test_a_span_past_the_first_with_no_output_held_for_it_is_a_plan_error() -> None:
    runner = ModelRunner(model(), MAX_BATCH, MAX_CONTEXT, CPU, torch.float32)
    long, other = seq("long", 100), seq("other", 100)
    first = StepPlan.build([], [], sliced=(long, PromptChunk(0, 0, 100), SublayerSpan(0, 2, False)))
    runner.forward(first)
    with pytest.raises(PlanError, match="layer-sliced prefill of other: sublayers from 2 row 0 on, but no output "
                                        "of the layers before is held for it"):
        runner.forward(StepPlan.build([], [], sliced=(other, PromptChunk(1, 0, 100), SublayerSpan(2, 4, False))))
    with pytest.raises(PlanError, match="layer-sliced prefill of long: sublayers from 2 row 0 on"):  # its length differs
        runner.forward(StepPlan.build([], [], sliced=(long, PromptChunk(0, 0, 50), SublayerSpan(2, 4, False))))
    assert runner.forward(StepPlan.build([], [], sliced=(long, PromptChunk(0, 0, 100), SublayerSpan(2, 10, True))))\
        .sampled.shape == (1, runner.model.config.vocab_size)


# -- the budget's edges (what the mutation run found untested) ------------------------------------

def exact(decode: float = 2**-5) -> PrefillBudget:
    """A budget of 64 sublayers whose numbers are binary-exact: a decode step of 2^-5 s and an idle
    prefill of 2^-11 s a token, so a step's share is 2 x 2^-5 / 2^-11 = 128 idle tokens."""
    budget = PrefillBudget(None, 4096, sublayers=64)
    budget.observe(8, [], decode)
    budget.observe(0, [PromptChunk(9, 0, 1024)], 0.5)
    return budget


def test_a_sliced_steps_cost_weighs_its_attention_at_the_chunks_mean_position() -> None:
    budget = measured(parity=10.0, attention_share=0.25)  # a small parity: half a position shows
    chunk = PromptChunk(9, 0, 500)  # its mean position 249.5
    attention, mlp = 500 * (0.25 + 249.5 / 10) / 30, 500 * 0.75 / 30
    for _ in range(60):  # twice idle prefill's cost of those two sublayers
        budget.observe_slice(8, chunk, SublayerSpan(4, 6, False), 0.03125 + 2 * (attention + mlp) * 0.0005)
    assert budget.describe()["slice_cost"] == 2.0


def test_a_completing_span_that_fills_the_share_exactly_with_its_completion_runs_whole() -> None:
    budget = exact()  # 1,024 tokens: 16 a sublayer (2^-7 s), a share of 128
    chunk = PromptChunk(9, 0, 1024)
    # a completion of one decode step for 1,024 tokens: 2^-5 s, a weight of 64
    budget.observe_slice(8, chunk, SublayerSpan(63, 64, True), 2**-5 + 2**-7 + 2**-5)
    assert budget.slice_stop(8, chunk, 60) == (64, 0)  # 4 sublayers (64) and the completion (64): 128
    assert budget.slice_stop(8, chunk, 59) == (63, 896)  # 4 sublayers (64) and 7 buckets of the last (14)


def test_the_slice_cost_is_a_moving_average_shown_to_three_places() -> None:
    budget = exact()
    chunk = PromptChunk(9, 0, 1024)  # 16 idle tokens a sublayer: 2^-7 s
    budget.observe_slice(8, chunk, SublayerSpan(0, 1, False), 2**-5 + 1.8 * 2**-7)  # cost 1.8: 1 + 0.3 x 0.8
    assert budget.describe()["slice_cost"] == 1.24
    budget.observe_slice(8, chunk, SublayerSpan(0, 1, False), 2**-5 + 1.8 * 2**-7)
    assert budget.describe()["slice_cost"] == 1.408  # 1.24 + 0.3 x 0.56
    budget.observe_slice(8, chunk, SublayerSpan(0, 1, False), 2**-5 + 1.8 * 2**-7)
    assert budget.describe()["slice_cost"] == 1.526  # 1.5256, to three places


def test_a_slice_step_with_nothing_to_count_it_against_teaches_nothing() -> None:
    chunk = PromptChunk(9, 0, 1024)
    decode_only = PrefillBudget(None, 4096, sublayers=64)
    decode_only.observe(8, [], 2**-5)
    idle_only = PrefillBudget(None, 4096, sublayers=64)
    idle_only.observe(0, [chunk], 0.5)
    free_idle = PrefillBudget(None, 4096, sublayers=64)  # an idle prefill that took no time at all
    free_idle.observe(8, [], 2**-5)
    free_idle.observe(0, [chunk], 0.0)
    for budget in (decode_only, idle_only, free_idle):
        budget.observe_slice(8, chunk, SublayerSpan(0, 1, False), 1.0)
        assert budget.describe()["slice_cost"] == 1.0
        assert budget.slice_tokens(8, 0, 5000) is None and budget.slice_stop(8, chunk, 0) == (64, 0)
    nothing_decoding = exact()
    nothing_decoding.observe_slice(0, chunk, SublayerSpan(0, 1, False), 1.0)  # the rows left: no decode step in it
    assert nothing_decoding.describe()["slice_cost"] == 1.0
