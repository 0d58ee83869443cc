"""The decode loop's thread, in-process: how it idles, how it stops, and its fatal path (an error it
does not understand is logged as engine_fatal, handed to on_fatal, and the process exits 70 from a
watchdog if nothing else ends it). The step-by-step policy is in test_loop_unit.py; these cover the
thread around it (found by `make mutate`, docs/mutation-testing.md)."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence as Seq
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine_service.faults import FaultInjector, FaultPlan
from engine_service.generation import controls as controls_module
from engine_service.generation.controls import FinishReason
from engine_service.generation.logprobs import TokenLogprobs, token_logprobs
from engine_service.generation.output_text import OutputText
from engine_service.generation.sampler import new_generator
from engine_service.generation.speculative import SpeculativeConfig
from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.presets import PRESETS
from engine_service.requests import Request, SamplingParams
from engine_service.runtime import loop as loop_module
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import FATAL_EXIT_CODE, DecodeLoop, set_threads
from engine_service.runtime.model_runner import StepLogits
from engine_service.runtime.speculator import Speculator
from engine_service.scheduling.prefill_budget import PrefillBudget
from engine_service.scheduling.prefix_cache import BLOCK_TOKENS, PrefixCache, PrefixCacheStats
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import StepPlan
from shared.errors import DeadlineExceeded, SequenceError
from tests.step_plans import unpack

WAIT = 5.0  # seconds a test waits for a thread before it fails (passing runs take milliseconds)


class OneHotRunner:
    """Logits that always pick token 1; a cache that only counts row moves."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.cache = self
        self.forwards = 0

    def move_row(self, src: int, dst: int, length: int) -> None:
        del src, dst, length

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        del a, b, length_a, length_b

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        self.forwards += 1
        logits = torch.zeros(len(decoding) + sum(p.completes for p in prefills), 8)
        logits[:, 1] = 1.0
        return StepLogits(logits)


class ExtraRowRunner(OneHotRunner):
    """A runner with a shape bug: one row of logits more than sequences running."""

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        return StepLogits(torch.zeros(len(decoding) + sum(p.completes for p in prefills) + 1, 8))


def request(request_id: str, max_new: int = 3, deadline: float | None = None, sampling: SamplingParams | None = None,
            stop: frozenset[int] = frozenset(), ignore_eos: bool = True) -> Request:
    return Request(request_id=request_id, prompt_ids=(2, 3), max_new_tokens=max_new,
                   sampling=sampling or SamplingParams(), stop_token_ids=stop, ignore_eos=ignore_eos,
                   deadline=deadline)


def scheduler() -> Scheduler:
    return Scheduler(max_batch=4, max_context=16, queue_capacity=4, queue_retry_seconds=0.5, prefill_token_budget=64)


class Harness:
    """A DecodeLoop stepped by the test itself (no thread)."""

    def __init__(self, faults: FaultPlan | None = None, end: frozenset[int] = frozenset(),
                 runner: OneHotRunner | None = None) -> None:
        self.sched = scheduler()
        self.delivered: list[list[Delta]] = []
        self.loop = DecodeLoop(runner or OneHotRunner(), self.sched, FaultInjector(faults or FaultPlan()),  # type: ignore[arg-type]
                               end, self.delivered.append, on_fatal=lambda exc: pytest.fail(f"on_fatal: {exc!r}"))

    def submit(self, *requests: Request, trace: dict[str, str] | None = None) -> list[Sequence]:
        seqs = [Sequence(r, sink=None, trace=dict(trace or {})) for r in requests]
        for seq in seqs:
            self.sched.submit(seq)
        return seqs

    def step(self) -> tuple[float, dict[str, Delta], float]:
        """(time before, this step's emissions by request id, time after)."""
        before = time.monotonic()
        self.loop.step()
        return before, {e.seq.request_id: e for e in self.delivered[-1]}, time.monotonic()


class Recorder:
    """Stands in for the module's structlog logger: (level, event, fields) of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str):  # type: ignore[no-untyped-def]
        return lambda event, **fields: self.calls.append((level, event, fields))


def test_the_loop_thread_serves_then_stops_when_asked() -> None:
    delivered: queue.Queue[list[Delta]] = queue.Queue()
    sched = scheduler()
    loop = DecodeLoop(OneHotRunner(), sched, FaultInjector(FaultPlan()), frozenset(), delivered.put,  # type: ignore[arg-type]
                      on_fatal=lambda exc: pytest.fail(f"on_fatal: {exc!r}"))
    loop.start()
    assert loop._thread.name == "decode-loop" and loop._thread.daemon  # as thread dumps name it; never blocks exit
    seq = Sequence(request("a"), sink=None)
    sched.submit(seq)
    tokens = []
    while len(tokens) < 3:
        tokens += [t for e in delivered.get(timeout=WAIT) for t in e.tokens]
    assert tokens == [1, 1, 1] and seq.generated == [1, 1, 1]
    loop.stop()
    assert not loop._thread.is_alive()


def test_stop_waits_a_bounded_time_for_a_stuck_step() -> None:
    joined: list[float | None] = []
    loop = DecodeLoop(OneHotRunner(), scheduler(), FaultInjector(FaultPlan()), frozenset(), lambda out: None,  # type: ignore[arg-type]
                      on_fatal=lambda exc: None)
    loop._thread = type("StuckThread", (), {"join": lambda self, timeout=None: joined.append(timeout)})()
    loop.stop()
    assert joined == [5.0]  # never join(None): a stuck forward must not hang the shutdown
    assert loop.scheduler.wait_for_work() is False


def test_an_error_the_loop_does_not_understand_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: queue.Queue[int] = queue.Queue()
    fatal: queue.Queue[BaseException] = queue.Queue()
    timers: list[threading.Timer] = []

    class RecordingTimer(threading.Timer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            timers.append(self)

    log = Recorder()
    monkeypatch.setattr(threading, "Timer", RecordingTimer)
    monkeypatch.setattr(os, "_exit", exits.put)
    monkeypatch.setattr(loop_module, "FATAL_EXIT_AFTER_SECONDS", 0.05)
    monkeypatch.setattr(loop_module, "log", log)
    sched = scheduler()
    loop = DecodeLoop(OneHotRunner(), sched, FaultInjector(FaultPlan(crash_step=2)), frozenset(),  # type: ignore[arg-type]
                      lambda out: None, on_fatal=fatal.put)
    sched.submit(Sequence(request("a", max_new=5), sink=None))
    try:
        loop.start()
        exc = fatal.get(timeout=WAIT)
        code = exits.get(timeout=WAIT)
    finally:
        for timer in timers:
            timer.cancel()
        loop.stop(timeout=WAIT)
    assert isinstance(exc, RuntimeError) and str(exc) == "injected crash at decode step 2 (--fault crash:step=2)"
    assert code == FATAL_EXIT_CODE == 70
    (timer,) = [t for t in timers if t.function == exits.put]  # the watchdog
    assert timer.daemon is True and timer.interval == 0.05
    assert log.calls == [("critical", "engine_fatal", {"error_type": "RuntimeError", "step": 2, "exc_info": exc})]
    assert not loop._thread.is_alive(), "no retry: the loop thread ends"


def test_a_dropped_sequence_is_stamped_with_the_step_time() -> None:
    h = Harness()
    running, = h.submit(request("running", max_new=5))
    h.step()
    expired, cancelled = h.submit(request("late", deadline=time.monotonic() - 1.0), request("gone"))
    cancelled.cancelled = True
    running.cancelled = True
    before, out, after = h.step()
    assert isinstance(out["late"].error, DeadlineExceeded) and out["gone"].error is None
    assert out["running"].error is None and h.sched.rows == ()
    assert all(before <= out[r].at <= after and out[r].tokens == () for r in ("late", "gone", "running"))


def test_each_step_stamps_prefill_first_and_last_token_times() -> None:
    h = Harness()
    seq, = h.submit(request("a"))
    before, out, after = h.step()
    first = out["a"].at
    assert before <= seq.timings.prefill_started <= first <= after
    assert seq.timings.first_token == seq.timings.last_token == first
    before, out, after = h.step()
    assert before <= out["a"].at <= after
    assert (seq.timings.first_token, seq.timings.last_token) == (first, out["a"].at)


def test_a_sampled_sequence_gets_its_own_seeded_generator_when_admitted() -> None:
    h = Harness()
    sampled, greedy = h.submit(request("s", sampling=SamplingParams(temperature=1.0, seed=7)), request("g"))
    assert sampled.controls.generator is None
    h.step()
    assert isinstance(sampled.controls.generator, torch.Generator) and sampled.controls.generator.initial_seed() == 7
    assert greedy.controls.generator is None


def test_stop_and_end_tokens_finish_a_sequence() -> None:
    h = Harness(end=frozenset({1}))  # the runner always produces token 1
    h.submit(request("stop", max_new=5, stop=frozenset({1})), request("eos", max_new=5, ignore_eos=False),
             request("ignores", max_new=5))
    _, out, _ = h.step()
    assert {r: e.finish for r, e in out.items()} == {"stop": FinishReason.STOP, "eos": FinishReason.EOS,
                                                     "ignores": None}


def test_a_runner_shape_bug_is_not_spread_over_the_wrong_rows() -> None:
    h = Harness(runner=ExtraRowRunner())
    h.submit(request("a"))
    with pytest.raises(ValueError, match="one entry per row of logits"):  # the loop's caller turns this into engine_fatal
        h.step()


def test_an_aborted_sequence_is_logged_with_its_trace_and_answered_at_the_step_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = Recorder()
    monkeypatch.setattr(loop_module, "log", log)
    h = Harness(FaultPlan(sequence_error_steps=frozenset({1})))
    h.submit(request("a"), trace={"trace_id": "t1", "span_id": "s1"})
    before, out, after = h.step()
    assert isinstance(out["a"].error, SequenceError) and before <= out["a"].at <= after
    assert log.calls == [("warning", "sequence_aborted", {
        "request_id": "a", "trace_id": "t1", "span_id": "s1", "reason": "SEQUENCE_ABORTED",
        "cause": "injected sequence error at decode step 1"})]


def test_a_rate_doomed_request_fails_once_it_has_one_token() -> None:
    h = Harness(FaultPlan(sequence_error_rate=1.0))  # dooms every request
    h.submit(request("a", max_new=5))
    _, out, _ = h.step()
    assert out["a"].tokens == (1,) and out["a"].error is None
    _, out, _ = h.step()
    err = out["a"].error
    assert isinstance(err, SequenceError) and err.metadata["generatedTokens"] == "1"


def test_set_threads_sets_torch_threads_unless_zero() -> None:
    before = torch.get_num_threads()
    try:
        set_threads(0)
        assert torch.get_num_threads() == before
        set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- the prefill budget, the prefill_step event, the generator's device (found by `make mutate`) ------

STEP_SECONDS = 0.01234


class Clock:
    """Stands in for the loop's `time` module: perf_counter advances STEP_SECONDS a call, so every
    step the loop times (two calls: before its forward, after its sampling) takes STEP_SECONDS."""

    def __init__(self) -> None:
        self.calls = 0
        self.monotonic = time.monotonic

    def perf_counter(self) -> float:
        self.calls += 1
        return 100.0 + self.calls * STEP_SECONDS


class SpyBudget(PrefillBudget):
    """The adaptive budget, recording what the loop asks and tells it."""

    def __init__(self) -> None:
        super().__init__(None, 4096)
        self.calls: list[tuple[object, ...]] = []
        self.answers: list[int] = []

    def tokens(self, decoding: int, position: int) -> int:
        self.calls.append(("tokens", decoding, position))
        self.answers.append(super().tokens(decoding, position))
        return self.answers[-1]

    def observe(self, decoding: int, chunks: Seq[PromptChunk], seconds: float) -> None:
        self.calls.append(("observe", decoding, [(c.row, c.start, c.length) for c in chunks], round(seconds, 9)))
        super().observe(decoding, chunks, seconds)


def budget_harness(monkeypatch: pytest.MonkeyPatch, budget: PrefillBudget) -> Harness:
    monkeypatch.setattr(loop_module, "time", Clock())
    h = Harness()
    h.loop = DecodeLoop(OneHotRunner(), h.sched, FaultInjector(FaultPlan()), frozenset(), h.delivered.append,  # type: ignore[arg-type]
                        on_fatal=lambda exc: pytest.fail(f"on_fatal: {exc!r}"), prefill_budget=budget)
    return h


def test_each_step_asks_the_budget_for_its_decoding_rows_and_tells_it_the_steps_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    budget = SpyBudget()
    h = budget_harness(monkeypatch, budget)
    h.submit(request("a", max_new=5))
    h.step()  # a prefills alone
    h.submit(request("b", max_new=5))
    h.step()  # a decodes, b prefills beside it
    h.step()  # both decode
    assert budget.calls == [
        ("tokens", 0, 0), ("observe", 0, [(0, 0, 2)], STEP_SECONDS),
        ("tokens", 1, 0), ("observe", 1, [(1, 0, 2)], STEP_SECONDS),
        ("tokens", 2, 0), ("observe", 2, [], STEP_SECONDS),
    ]
    assert h.sched.prefill_token_budget == budget.answers[-1]  # each step plans with what the budget said
    assert budget.describe()["decode_ms"] == {2: 12.34}


def test_a_step_that_prefills_beside_decoding_rows_logs_prefill_step(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = PrefillBudget(48, 16)
    h = budget_harness(monkeypatch, budget)
    log = Recorder()
    monkeypatch.setattr(loop_module, "log", log)
    h.submit(request("a", max_new=5))
    h.step()  # a prefills alone: nobody waits on it, no event
    h.step()  # a decodes alone: no event
    assert log.calls == []
    h.submit(request("b", max_new=5))
    h.step()
    # 12.34 ms for a's 2 prompt tokens; b's chunk beside a took no longer than a's decode step: a chunk
    # token that cost nothing counts as one idle token (the least), averaged into the prior 1.5
    estimates = {"fixed": 48, "parity": None, "token_ms_idle": 6.17, "chunk_cost": {1: 1.35}, "decode_ms": {1: 12.34}}
    assert budget.describe() == estimates
    assert log.calls == [("debug", "prefill_step", {"decoding": 1, "tokens": 2, "position": 0, "budget": 48, "ms": 12.3,
                                                     **estimates})]


def test_a_sequences_generator_is_made_for_the_runners_device(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[object] = []

    def recording(params: SamplingParams, device: torch.device) -> torch.Generator | None:
        devices.append(device)
        return new_generator(params, device)

    monkeypatch.setattr(controls_module, "new_generator", recording)
    h = Harness()
    h.submit(request("s", sampling=SamplingParams(temperature=1.0, seed=7)))
    h.step()
    assert devices == [torch.device("cpu")]  # OneHotRunner's; on CUDA, the draws need a CUDA generator


# -- the prefix cache in the loop, with a real KV cache ------------------------------------------

MAX_CONTEXT = 64


def kv_value(token: int, position: int) -> float:
    """The key the fake model computes for `token` at `position` (its value is the negative)."""
    return token * 1000.0 + position


def kv_of(tokens: tuple[int, ...] | list[int]) -> torch.Tensor:
    """(layers, KV heads, len(tokens), head dim) of the keys `KVRunner` writes for `tokens` from position 0."""
    config = PRESETS["tiny"]
    column = torch.tensor([kv_value(t, p) for p, t in enumerate(tokens)])
    return column[None, None, :, None].expand(config.num_hidden_layers, config.num_key_value_heads, len(tokens),
                                              config.dim_per_head)


class KVRunner:
    """A real KVCache (the tiny preset's shape) that each forward writes as a model would: every
    input token's key (`kv_value`) and value at its position in its row. Greedy logits: the next
    token is 3 + (the text's length x 7) mod 50."""

    def __init__(self, max_batch: int) -> None:
        self.device = torch.device("cpu")
        self.cache = KVCache(PRESETS["tiny"], max_batch, MAX_CONTEXT, torch.float32, self.device)
        self.chunks: list[tuple[str, PromptChunk]] = []

    def _write(self, row: int, start: int, tokens: tuple[int, ...] | list[int]) -> None:
        for i, token in enumerate(tokens):
            self.cache.k[:, row, :, start + i] = kv_value(token, start + i)
            self.cache.v[:, row, :, start + i] = -kv_value(token, start + i)

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        for row, seq in enumerate(decoding):
            self._write(row, seq.total_len - 1, seq.generated[-1:])
        for p in prefills:
            self.chunks.append((p.seq.request_id, p.chunk))
            self._write(p.chunk.row, p.chunk.start, p.seq.request.prompt_ids[p.chunk.start:p.chunk.start + p.chunk.length])
        producing = decoding + [p.seq for p in prefills if p.completes]
        logits = torch.zeros(len(producing), 64)
        for row, seq in enumerate(producing):
            logits[row, 3 + seq.total_len * 7 % 50] = 1.0
        return StepLogits(logits)


def prefix_harness(prefix: PrefixCache) -> tuple[Harness, KVRunner]:
    runner = KVRunner(max_batch=2)
    h = Harness()
    h.sched = Scheduler(max_batch=2, max_context=MAX_CONTEXT, queue_capacity=4, queue_retry_seconds=0.5,
                        prefill_token_budget=64)
    h.loop = DecodeLoop(runner, h.sched, FaultInjector(FaultPlan()), frozenset(), h.delivered.append,  # type: ignore[arg-type]
                        on_fatal=lambda exc: pytest.fail(f"on_fatal: {exc!r}"), prefix_cache=prefix)
    return h, runner


def test_the_loop_stores_prompt_and_answer_blocks_and_reuses_them_in_the_new_row() -> None:
    prefix = PrefixCache(4 * BLOCK_TOKENS)
    h, runner = prefix_harness(prefix)
    assert h.sched.load.prefix_cache == PrefixCacheStats(0, 64, 0, 0)  # published from the start
    first, = h.submit(Request(request_id="first", prompt_ids=tuple(range(100, 120)), max_new_tokens=14,
                              sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None))
    h.step()  # its prompt: one full block stored, from its row
    assert h.sched.load.prefix_cache == PrefixCacheStats(16, 64, 20, 0)
    while h.sched.rows:
        h.step()
    text = first.request.prompt_ids + tuple(first.generated)  # 34 tokens, 33 of them in the cache
    assert h.sched.load.prefix_cache.used_tokens == 32  # its answer's first block too, when it finished
    h.submit(request("other", max_new=30))  # decodes in row 0 (which held "first") while "next" is admitted
    h.step()
    next_, = h.submit(Request(request_id="next", prompt_ids=text[:32] + (7, 8, 9, 10), max_new_tokens=2,
                              sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None))
    h.step()
    assert next_.cached_tokens == 32
    assert runner.chunks[-1] == ("next", PromptChunk(1, 32, 4))  # only the rest of its prompt is prefilled
    cache = runner.cache
    assert torch.equal(cache.k[:, 1, :, :36], kv_of(next_.request.prompt_ids))  # copied into its own row
    assert torch.equal(cache.v[:, 1, :, :36], -kv_of(next_.request.prompt_ids))
    assert torch.equal(cache.k[:, 0, :, :2], kv_of((2, 3)))  # "other"'s row untouched
    assert h.sched.load.prefix_cache == PrefixCacheStats(32, 64, 20 + 2 + 36, 32)


def test_an_idle_step_publishes_the_prefix_caches_stats_as_they_are() -> None:
    prefix = PrefixCache(4 * BLOCK_TOKENS)
    h, runner = prefix_harness(prefix)
    prefix.offer(tuple(range(16)), runner.cache, 0, 16)  # warmed by someone else since the loop published
    h.step()  # nothing to run
    assert h.sched.load.prefix_cache == PrefixCacheStats(16, 64, 0, 0)


# -- what an emission carries: text, log-probabilities, penalties, constraints (found by `make mutate`) --

VOCAB = 16
EOS = 15
STOP_TOKEN = 14


def noise(seq: Sequence, position: int) -> torch.Tensor:
    """(VOCAB,) values in [0, 1), a pure function of the request and the position: no two rows
    alike, so a log-probability read from the wrong row shows."""
    generator = torch.Generator().manual_seed(sum(map(ord, seq.request_id)) * 1000 + position)
    return torch.rand(VOCAB, generator=generator)


class TableRunner:
    """Logits from `table(seq, position)`: the row that predicts the token at `position` of the
    sequence's text (prompt and output, from 0), wherever the step needs it, as the real runner
    lays them out (model_runner.py): a decoding row's (and with drafts, one more per draft token),
    then each completing prefill's; and for a request with echo_prompt_logprobs, each chunk's rows
    (StepLogits.prompt), row j predicting position chunk.start + j + 1."""

    def __init__(self, table: Any, cache: Any = None) -> None:
        self.device = torch.device("cpu")
        self.cache = cache if cache is not None else self
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB))  # what Penalties is sized by
        self.table = table
        self.chunks: list[tuple[str, PromptChunk]] = []
        self.drafts: list[list[list[int]] | None] = []

    def move_row(self, src: int, dst: int, length: int) -> None:
        del src, dst, length

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        del a, b, length_a, length_b

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        self.drafts.append(drafts)
        sampled = [self.table(seq, seq.total_len + j) for i, seq in enumerate(decoding)
                   for j in range(1 + (len(drafts[i]) if drafts is not None else 0))]
        prompt = {}
        for i, p in enumerate(prefills):
            self.chunks.append((p.seq.request_id, p.chunk))
            if p.seq.request.echo_prompt_logprobs:
                prompt[i] = torch.stack([self.table(p.seq, p.chunk.start + j + 1) for j in range(p.chunk.length)])
            if p.completes:
                sampled.append(self.table(p.seq, len(p.seq.request.prompt_ids)))
        return StepLogits(torch.stack(sampled) if sampled else torch.zeros(0, VOCAB), prompt)


def table_harness(table: Any, end: frozenset[int] = frozenset(), prefill_budget: int = 64,
                  speculator: Speculator | None = None, cache: Any = None,
                  prefix_cache: PrefixCache | None = None) -> tuple[Harness, TableRunner]:
    runner = TableRunner(table, cache)
    h = Harness()
    h.sched = Scheduler(max_batch=4, max_context=MAX_CONTEXT, queue_capacity=8, queue_retry_seconds=0.5,
                        prefill_token_budget=prefill_budget)
    h.loop = DecodeLoop(runner, h.sched, FaultInjector(FaultPlan()), end, h.delivered.append,  # type: ignore[arg-type]
                        on_fatal=lambda exc: pytest.fail(f"on_fatal: {exc!r}"), prefix_cache=prefix_cache,
                        speculator=speculator)
    return h, runner


def req(request_id: str, prompt: tuple[int, ...] = (2, 3), max_new: int = 3, sampling: SamplingParams | None = None,
        stop_tokens: frozenset[int] = frozenset(), ignore_eos: bool = True, top_logprobs: int = 0,
        echo: bool = False) -> Request:
    return Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new,
                   sampling=sampling or SamplingParams(), stop_token_ids=stop_tokens, ignore_eos=ignore_eos,
                   deadline=None, top_logprobs=top_logprobs, echo_prompt_logprobs=echo)


def busy(h: Harness) -> bool:
    return bool(h.sched.rows or h.sched.waiting_count())


def expected_logprobs(table: Any, seq: Sequence, positions: range | list[int], top: int) -> list[TokenLogprobs]:
    """What the token at each of `positions` of `seq`'s text scores under the raw logits that predicted it."""
    text = seq.request.prompt_ids + tuple(seq.generated)
    return [token_logprobs(table(seq, p)[None], [text[p]], top)[0] for p in positions]


def assert_logprobs(actual: tuple[TokenLogprobs, ...] | list[TokenLogprobs], expected: list[TokenLogprobs]) -> None:
    assert len(actual) == len(expected) and expected
    for got, want in zip(actual, expected, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, rel=1e-5, abs=1e-6)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], rel=1e-5, abs=1e-6)


def ranked(*order: int) -> Any:
    """A table whose logits rank `order` first (3.0, 2.0, 1.0, ...), the rest near 0."""
    def table(seq: Sequence, position: int) -> torch.Tensor:
        logits = noise(seq, position) * 0.01
        for rank, token in enumerate(order):
            logits[token] = 3.0 - rank
        return logits
    return table


def test_a_plain_emission_carries_no_text_and_no_logprobs() -> None:
    h, _ = table_harness(ranked(5))
    h.submit(req("a", max_new=2))
    _, out, _ = h.step()
    assert out["a"].tokens == (5,)
    assert (out["a"].text, out["a"].logprobs, out["a"].prompt_logprobs) == ("", (), ())


def test_min_new_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    h, _ = table_harness(ranked(EOS, STOP_TOKEN, 5), end=frozenset({EOS}))
    seq, = h.submit(req("a", max_new=6, sampling=SamplingParams(min_new_tokens=2),
                        stop_tokens=frozenset({STOP_TOKEN}), ignore_eos=False))
    while busy(h):
        _, out, _ = h.step()
    assert seq.generated == [5, 5, EOS] and out["a"].finish is FinishReason.EOS


class FakeConstraint:
    """Stands in for constraint.Constraint: the tokens its grammar allows at each step (read by
    `masks` below, in place of apply_masks), the tokens consumed, and done once it consumed `final`."""

    def __init__(self, allowed: list[set[int]], final: int) -> None:
        self.allowed = allowed
        self.final = final
        self.consumed: list[tuple[int, ...]] = []

    def consume(self, tokens: tuple[int, ...]) -> None:
        self.consumed.append(tokens)

    @property
    def done(self) -> bool:
        return bool(self.consumed) and self.final in self.consumed[-1]


def masks(logits: torch.Tensor, rows: list[int], constraints: list[FakeConstraint]) -> torch.Tensor:
    for row, constraint in zip(rows, constraints, strict=True):
        forbidden = torch.ones(logits.shape[1], dtype=torch.bool)
        forbidden[sorted(constraint.allowed[len(constraint.consumed)])] = False
        logits[row].masked_fill_(forbidden, float("-inf"))
    return logits


def test_a_constrained_rows_eos_is_its_grammars_under_min_new_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controls_module, "apply_masks", masks)
    h, _ = table_harness(ranked(EOS, STOP_TOKEN, 5), end=frozenset({EOS}))
    seq, = h.submit(req("a", max_new=6, sampling=SamplingParams(min_new_tokens=4),
                        stop_tokens=frozenset({STOP_TOKEN}), ignore_eos=False))
    # the grammar first allows 5 or the stop token (min_new_tokens masks the stop token), then EOS too:
    # its EOS is not masked (the grammar decides where the output may end), the stop token still is
    seq.controls.constraint = FakeConstraint([{5, STOP_TOKEN}, {5, STOP_TOKEN, EOS}], final=EOS)  # type: ignore[assignment]
    _, first, _ = h.step()
    _, second, _ = h.step()
    assert (first["a"].tokens, first["a"].finish) == ((5,), None)
    assert (second["a"].tokens, second["a"].finish) == ((EOS,), FinishReason.STOP)  # the grammar is done
    assert seq.controls.constraint.consumed == [(5,), (EOS,)]  # type: ignore[union-attr]
    assert h.sched.rows == ()


class FakeDecoder:
    """A stream decoder over a fixed table of token texts."""

    TEXTS = {1: "ab", 2: "c", 3: "de", 4: "f"}

    def step(self, ids: tuple[int, ...]) -> str:
        return "".join(self.TEXTS[i] for i in ids)


def script(*tokens: int) -> Any:
    """A table whose argmax at output position k is tokens[k]."""
    def table(seq: Sequence, position: int) -> torch.Tensor:
        logits = noise(seq, position) * 0.01
        logits[tokens[position - len(seq.request.prompt_ids)]] = 3.0
        return logits
    return table


def test_a_stop_string_across_tokens_holds_back_its_start_and_ends_the_sequence() -> None:
    h, _ = table_harness(script(1, 2, 3, 4))
    seq, = h.submit(req("a", max_new=4))
    seq.controls.text = OutputText(FakeDecoder(), stop=["cd"])
    texts = []
    while busy(h):
        _, out, _ = h.step()
        texts.append(out["a"].text)
    assert texts == ["ab", "", ""]  # "c" held back (it may start "cd"), then "cd" matched in "cde"
    assert seq.generated == [1, 2, 3] and out["a"].finish is FinishReason.STOP
    assert seq.controls.text.stop_string == "cd"


def test_a_held_back_tail_is_released_with_the_last_token_when_the_sequence_ends() -> None:
    h, _ = table_harness(script(1, 2))
    seq, = h.submit(req("a", max_new=2))
    seq.controls.text = OutputText(FakeDecoder(), stop=["cd"])
    _, first, _ = h.step()
    _, last, _ = h.step()
    assert (first["a"].text, last["a"].text) == ("ab", "c")  # "c" was held back, then flushed at the length limit
    assert last["a"].finish is FinishReason.LENGTH


def test_penalties_start_from_the_prompt_and_count_each_steps_tokens() -> None:
    table = ranked(1, 2)
    h, runner = table_harness(table)
    presence, repetition = h.submit(req("presence", prompt=(7, 8), sampling=SamplingParams(presence_penalty=1.5)),
                                    req("repetition", prompt=(1, 8), sampling=SamplingParams(repetition_penalty=4.0)))
    while busy(h):
        h.step()
    assert presence.generated == [1, 2, 1]  # 1 penalized once seen (3 - 1.5 < 2), then both (1.5 > 0.5)
    assert repetition.generated == [2, 1, 1]  # 1 is in the prompt: 3 / 4 < 2; then 2 / 4 < 3 / 4
    for seq in (presence, repetition):
        penalties = seq.controls.penalties
        assert penalties is not None and penalties.device == runner.device and penalties.vocab_size == VOCAB
        assert penalties.counts.tolist() == [float(seq.generated.count(t)) for t in range(VOCAB)]
        assert penalties.seen.nonzero().flatten().tolist() == sorted({*seq.request.prompt_ids, *seq.generated})


def test_logprobs_are_the_raw_logits_even_when_penalties_change_them() -> None:
    table = ranked(1, 2)
    h, _ = table_harness(table)
    seq, plain = h.submit(req("a", sampling=SamplingParams(presence_penalty=1.5, logit_bias=((3, 0.5),)),
                              top_logprobs=2), req("plain", max_new=1))
    emissions = []
    while busy(h):
        _, out, _ = h.step()
        emissions.append(out["a"])
    assert seq.generated == [1, 2, 1]
    prompt = len(seq.request.prompt_ids)
    for k, e in enumerate(emissions):
        assert_logprobs(e.logprobs, expected_logprobs(table, seq, [prompt + k], 2))
    assert plain.generated == [1]


def test_echoed_prompt_logprobs_come_chunk_by_chunk_on_the_first_emission() -> None:
    table = ranked(5)
    h, runner = table_harness(table, prefill_budget=4)  # while a row decodes, prompts go in chunks of 4
    h.submit(req("busy", max_new=10))
    h.step()
    seq, = h.submit(req("echo", prompt=tuple(range(1, 11)), max_new=2, top_logprobs=2, echo=True))
    emissions = []
    while len(emissions) < 2:
        _, out, _ = h.step()
        if "echo" in out:
            emissions.append(out["echo"])
    assert [c for r, c in runner.chunks if r == "echo"] == [PromptChunk(1, 0, 4), PromptChunk(1, 4, 4),
                                                            PromptChunk(1, 8, 2)]
    # each prompt token after the first, scored by the row before it; the last row predicts no prompt token
    assert_logprobs(emissions[0].prompt_logprobs, expected_logprobs(table, seq, range(1, 10), 2))
    assert_logprobs(seq.controls.prompt_logprobs, expected_logprobs(table, seq, range(1, 10), 2))
    assert emissions[1].prompt_logprobs == ()  # the first emission only
    assert_logprobs(emissions[0].logprobs, expected_logprobs(table, seq, [10], 2))
    assert_logprobs(emissions[1].logprobs, expected_logprobs(table, seq, [11], 2))


def test_an_echoed_prompt_is_computed_whole_past_the_prefix_cache() -> None:
    table = ranked(5)
    prefix = PrefixCache(4 * BLOCK_TOKENS)
    h, runner = table_harness(table, cache=KVCache(PRESETS["tiny"], 4, MAX_CONTEXT, torch.float32, torch.device("cpu")),
                              prefix_cache=prefix)
    prompt = tuple(i * 7 % 13 for i in range(20))
    h.submit(req("warm", prompt=prompt, max_new=1))
    h.step()  # its first block is stored
    cached, echo = h.submit(req("cached", prompt=prompt, max_new=1),
                            req("echo", prompt=prompt, max_new=1, top_logprobs=1, echo=True))
    _, out, _ = h.step()
    assert cached.cached_tokens == 16  # the block was there to reuse
    assert (echo.cached_tokens, echo.cache_len) == (0, 20)
    assert [c.start for r, c in runner.chunks if r == "echo"] == [0]
    assert_logprobs(out["echo"].prompt_logprobs, expected_logprobs(table, echo, range(1, 20), 1))


def periodic(seq: Sequence, position: int) -> torch.Tensor:
    """Argmax: the prompt's period-3 pattern continued, so that prompt lookup drafts it and
    verification accepts it."""
    logits = noise(seq, position)
    logits[seq.request.prompt_ids[position % 3]] = 5.0
    return logits


def test_each_speculated_and_sampled_token_is_scored_by_its_own_row() -> None:
    h, runner = table_harness(periodic, speculator=Speculator(SpeculativeConfig(num_tokens=2)))
    pattern = (1, 2, 3) * 3
    # seeded sampled rows, sharp enough to take the argmax: greedy ones decode plainly beside a chunk
    sharp = SamplingParams(temperature=0.01, seed=1)
    a, b = h.submit(req("a", prompt=pattern, max_new=6, top_logprobs=2, sampling=sharp),
                    req("b", prompt=pattern[1:] + pattern[:1], max_new=6, top_logprobs=2, sampling=sharp))
    emitted = {"a": 0, "b": 0, "c": 0}
    logprobs: dict[str, list[TokenLogprobs]] = {"a": [], "b": [], "c": []}
    while busy(h):
        _, out, _ = h.step()
        if len(runner.drafts) == 1:  # a and b prefilled together (a plain step): c prefills beside their decoding
            c, = h.submit(req("c", prompt=(4, 5, 6), max_new=3, top_logprobs=2))
        for r, e in out.items():
            emitted[r] += len(e.tokens)
            logprobs[r] += e.logprobs
    assert runner.drafts[1] is not None and all(runner.drafts[1])  # step 2 verified a's and b's drafts beside c's prefill
    assert [c.start for r, c in runner.chunks if r == "c"] == [0] and len(runner.chunks) == 3
    for r, seq in {"a": a, "b": b, "c": c}.items():
        prompt = len(seq.request.prompt_ids)
        assert emitted[r] == len(seq.generated) == seq.request.max_new_tokens
        assert_logprobs(logprobs[r], expected_logprobs(periodic, seq, range(prompt, prompt + len(seq.generated)), 2))
