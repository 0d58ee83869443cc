"""Speculation inside the decode loop (speculator.py and the loop's multi-token emit), in-process
and in milliseconds: a fake model whose greedy continuation is periodic, so that prompt lookup
finds it, over a real Scheduler and DecodeLoop."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

import pytest
import torch

from engine_service.faults import FaultInjector, FaultPlan
from engine_service.generation.controls import Controls
from engine_service.generation.output_text import OutputText
from engine_service.generation.sampler import new_generator
from engine_service.generation.speculative import SpeculativeConfig, verify
from engine_service.model.kv_cache import PromptChunk
from engine_service.requests import Request, SamplingParams
from engine_service.runtime import loop as loop_module
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import DecodeLoop
from engine_service.runtime.model_runner import StepLogits
from engine_service.runtime.speculator import RETRY_EVERY, Speculator
from engine_service.scheduling.prefill_budget import PrefillBudget
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import PlanError, StepPlan
from tests.step_plans import unpack
from tests.test_loop_mutants import Clock, Recorder

VOCAB = 16
PERIOD = 5  # the fake model's text repeats every 5 tokens


def continuation(seq: Sequence, at: int) -> int:
    """The fake model's argmax after the first `at` tokens of `seq`'s text."""
    return (seq.request.prompt_ids[0] + at) % PERIOD


class FakeCache:
    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        pass


class SpeculatingRunner:
    """One-hot logits of `continuation`; with drafts, 1 + len(draft) rows per decoding row, row j
    predicting the token after the row's text and its first j draft tokens (as the real runner)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.cache = FakeCache()
        self.drafts_seen: list[list[list[int]] | None] = []

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        self.drafts_seen.append(drafts)
        rows = []
        for i, seq in enumerate(decoding):
            for j in range(1 + (len(drafts[i]) if drafts is not None else 0)):
                rows.append(continuation(seq, seq.total_len + j))
        rows += [continuation(p.seq, len(p.seq.request.prompt_ids)) for p in prefills if p.completes]
        logits = torch.zeros(len(rows), VOCAB)
        logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 1.0
        return StepLogits(logits)


def request(request_id: str, first: int, max_new: int, stop: frozenset[int] = frozenset()) -> Request:
    # the prompt is the model's own text, so lookup has something to match from the start
    prompt = tuple((first + i) % PERIOD for i in range(12))
    return Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new, sampling=SamplingParams(),
                   stop_token_ids=stop, ignore_eos=True, deadline=None)


class LetterDecoder:
    """A stream decoder giving token i the letter chr(97 + i)."""

    def step(self, ids: tuple[int, ...]) -> str:
        return "".join(chr(97 + i) for i in ids)


def run(requests: list[Request], speculator: Speculator | None, max_batch: int = 8,
        text: bool = False) -> tuple[dict[str, list[int]], list[Delta], SpeculatingRunner, list[Sequence]]:
    runner = SpeculatingRunner()
    scheduler = Scheduler(max_batch=max_batch, max_context=256, queue_capacity=16, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    delivered: list[list[Delta]] = []

    def fatal(exc: BaseException) -> None:
        raise AssertionError(f"the loop called on_fatal: {exc!r}")

    loop = DecodeLoop(runner, scheduler, FaultInjector(FaultPlan()), frozenset({15}), delivered.append,  # type: ignore[arg-type]
                      on_fatal=fatal, speculator=speculator)
    seqs = [Sequence(r, sink=None, controls=Controls(r, OutputText(LetterDecoder()) if text else None))
            for r in requests]
    for s in seqs:
        scheduler.submit(s)
    for _ in range(200):
        if not scheduler.rows and not scheduler.waiting_count():
            break
        loop.step()
        for s in scheduler.rows[:scheduler.decoding]:
            assert s.cache_len == s.total_len - 1  # every input is in the cache but the newest token
    emissions = [e for step in delivered for e in step]
    tokens = {s.request_id: list(s.generated) for s in seqs}
    return tokens, emissions, runner, seqs


def plain(first: int, max_new: int) -> list[int]:
    return [(first + 12 + i) % PERIOD for i in range(max_new)]


def test_greedy_tokens_equal_plain_decodings_and_drafts_are_accepted() -> None:
    requests = [request("a", 0, 23), request("b", 2, 7), request("c", 4, 1)]
    tokens, emissions, runner, seqs = run(requests, Speculator(SpeculativeConfig(num_tokens=4)))
    assert tokens == {"a": plain(0, 23), "b": plain(2, 7), "c": plain(4, 1)}
    assert tokens == run(requests, None)[0]
    a = seqs[0]
    assert a.controls.draft_tokens > 0 and a.controls.accepted_tokens == a.controls.draft_tokens  # the fake model always agrees
    # after the first token, each step gives the row its draft (up to 4) and the token after it
    assert max(len(e.tokens) for e in emissions) == 5
    assert sum(len(e.tokens) for e in emissions if e.seq is a) == 23
    assert [e.finish is not None for e in emissions if e.seq is a][-1]


def test_a_draft_never_runs_past_max_new_tokens() -> None:
    for max_new in range(1, 12):
        tokens, _, runner, _ = run([request("a", 1, max_new)], Speculator(SpeculativeConfig(num_tokens=6)))
        assert tokens["a"] == plain(1, max_new)
        for drafts in runner.drafts_seen:
            assert drafts is None or all(len(d) <= 6 for d in drafts)


def test_a_stop_token_inside_a_draft_ends_the_sequence_there() -> None:
    stop = frozenset({plain(0, 9)[8]})  # first produced at the 4th token (the text has period 5)
    tokens, emissions, _, seqs = run([request("a", 0, 40, stop=stop)], Speculator(SpeculativeConfig(num_tokens=6)))
    first_stop = plain(0, 40).index(next(iter(stop)))
    assert tokens["a"] == plain(0, 40)[:first_stop + 1]
    assert emissions[-1].finish is not None and emissions[-1].tokens[-1] in stop


def test_wrong_drafts_are_cut_at_the_first_mismatch() -> None:
    class Contrarian(SpeculatingRunner):
        """The model disagrees with every draft's second token."""

        def forward(self, plan: StepPlan) -> StepLogits:
            _, _, drafts = unpack(plan)
            logits = super().forward(plan).sampled
            if drafts is not None:
                at = 0
                for draft in drafts:
                    if len(draft) >= 2:
                        logits[at + 1] = torch.roll(logits[at + 1], 1)  # row 1 predicts draft[1]: now another
                    at += 1 + len(draft)
            return StepLogits(logits)

    speculator = Speculator(SpeculativeConfig(num_tokens=4))
    runner = Contrarian()
    scheduler = Scheduler(max_batch=2, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    delivered: list[list[Delta]] = []
    loop = DecodeLoop(runner, scheduler, FaultInjector(FaultPlan()), frozenset({15}), delivered.append,  # type: ignore[arg-type]
                      on_fatal=lambda exc: None, speculator=speculator)
    seq = Sequence(request("a", 3, 10), sink=None)
    scheduler.submit(seq)
    loop.step()  # prefill: the first token
    loop.step()  # a draft of 4: the first accepted, the second refused and replaced
    assert delivered[-1][0].tokens == (plain(3, 10)[1], (plain(3, 10)[2] + 1) % PERIOD)
    assert (seq.controls.draft_tokens, seq.controls.accepted_tokens) == (4, 1)
    assert seq.cache_len == seq.total_len - 1


def test_no_speculation_above_max_rows() -> None:
    lengths = [3, 12, 12, 12, 12]
    requests = [request(f"r{i}", i % PERIOD, n) for i, n in enumerate(lengths)]
    tokens, _, runner, _ = run(requests, Speculator(SpeculativeConfig(num_tokens=3), max_rows=4))
    assert tokens == {f"r{i}": plain(i % PERIOD, n) for i, n in enumerate(lengths)}
    assert runner.drafts_seen[1] is None  # 5 rows decoding: a plain step
    assert any(d is not None and len(d) <= 4 for d in runner.drafts_seen)  # as rows finish, it speculates


def test_speculator_drafts_and_choose_directly() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=3, min_n=2, max_n=2), max_rows=2)
    seq = Sequence(request("a", 0, 10), sink=None)
    seq.generated = [2, 3]  # text ... 0 1 2 3 4 0 1 2 3 4 0 1 | 2 3
    assert speculator.drafts([]) is None
    assert speculator.drafts([seq]) == [[4, 0, 1]]
    assert speculator.drafts([seq, seq, seq]) is None  # over max_rows
    seq.generated = [2, 3] + [4] * 6  # 8 of 10 generated: room for one token after this step's first
    seq.controls.ngram = None
    assert speculator.drafts([seq]) is None or all(len(d) <= 1 for d in speculator.drafts([seq]))
    logits = torch.zeros(4 + 1, VOCAB)
    for row, token in enumerate([4, 0, 2, 9]):
        logits[row, token] = 1.0
    logits[4, 7] = 1.0  # a completing prefill's row: the loop's to sample, not choose's
    out = Speculator.choose(logits, StepPlan.build([seq], [], [[4, 0, 1]]).decodes)
    assert out == [[4, 0, 2]]
    assert (seq.controls.draft_tokens, seq.controls.accepted_tokens) == (3, 2)
    with pytest.raises(PlanError):
        StepPlan.build([seq, Sequence(seq.request, sink=None)], [], [[4, 0, 1]])  # one draft per decoding row


def test_greedy_rows_beside_a_prompt_chunk_decode_plainly_and_sampled_ones_still_draft() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=3, min_n=2, max_n=2), max_rows=2)
    seq = Sequence(request("a", 0, 10), sink=None)
    seq.generated = [2, 3]
    assert speculator.drafts([seq], prefilling=True) is None
    assert speculator.drafts([seq], prefilling=False) == [[4, 0, 1]]
    sampled = Sequence(replace(seq.request, sampling=SamplingParams(temperature=0.8, seed=3)), sink=None)
    sampled.generated = [2, 3]
    # whether a step carries a chunk hangs on other requests' arrivals: a seeded row's draws must not
    assert speculator.drafts([seq, sampled], prefilling=True) == [[4, 0, 1]] * 2


def test_rows_whose_logits_are_processed_never_speculate() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=3, min_n=2, max_n=2), max_rows=2)
    seq = Sequence(request("a", 0, 10), sink=None)
    seq.generated = [2, 3]
    assert speculator.drafts([seq]) == [[4, 0, 1]]
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5),
                   SamplingParams(frequency_penalty=-0.5), SamplingParams(min_new_tokens=3),
                   SamplingParams(logit_bias=((1, 2.0),))):
        other = Sequence(replace(seq.request, sampling=params), sink=None)
        other.generated = [2, 3]
        assert speculator.drafts([seq, other]) is None, params
    constrained = Sequence(seq.request, sink=None)
    constrained.generated = [2, 3]
    constrained.controls.constraint = object()  # type: ignore[assignment]
    assert speculator.drafts([constrained]) is None


# -- found by `make mutate` (docs/mutation-testing.md) -------------------------------------------

def text_sequence(prompt: tuple[int, ...], max_new: int = 10, sampling: SamplingParams | None = None) -> Sequence:
    return Sequence(Request(request_id="t", prompt_ids=prompt, max_new_tokens=max_new,
                            sampling=sampling or SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True,
                            deadline=None), sink=None)


def test_a_draft_fills_exactly_the_room_left_after_this_steps_first_token() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=6))
    seq = Sequence(request("a", 0, 10), sink=None)  # text 0 1 2 3 4 0 1 2 3 4 0 1, then the model's own
    for generated, draft in ((6, [3, 4, 0]), (8, [0]), (9, None)):  # room 10 - generated - 1: 3, 1, 0
        seq.generated = plain(0, generated)
        seq.controls.ngram = None
        drafts = speculator.drafts([seq])
        assert drafts == (None if draft is None else [draft]), generated


def test_no_row_with_a_match_is_a_plain_step() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=4))
    assert speculator.drafts([text_sequence((1, 2, 3, 4)), text_sequence((5, 6, 7))]) is None


def test_the_index_uses_the_configs_ngram_range() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=2, min_n=1, max_n=2))
    longer_match = text_sequence((1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3))  # 2-gram [2, 3] last seen before 8; 3-gram before 9
    one_token_match = text_sequence((4, 6, 4))  # only the 1-gram [4] repeats
    assert speculator.drafts([longer_match, one_token_match]) == [[8, 1], [6, 4]]
    assert (longer_match.controls.ngram.min_n, longer_match.controls.ngram.max_n) == (1, 2)  # type: ignore[union-attr]


def test_choose_verifies_a_sampled_row_with_its_own_generator() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    seq = text_sequence((0, 1, 2), sampling=params)
    seq.controls.generator = new_generator(params, torch.device("cpu"))
    twin = new_generator(params, torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 1.5, 0.3, 1.0], [1.0, 0.0, 1.0, 0.2]])
    with torch.random.fork_rng():
        for global_seed in range(40):
            torch.manual_seed(global_seed)
            plan = StepPlan.build([seq], [], [[0, 1]])
            assert Speculator.choose(logits, plan.decodes) == [verify([0, 1], logits, params, twin)]


class SpyBudget(PrefillBudget):
    def __init__(self) -> None:
        super().__init__(None, 256)
        self.observed: list[tuple[int, int]] = []

    def observe(self, decoding: int, chunks: Seq[PromptChunk], seconds: float) -> None:
        self.observed.append((decoding, sum(c.length for c in chunks)))
        super().observe(decoding, chunks, seconds)


def test_a_speculating_step_does_not_feed_the_prefill_budget() -> None:
    runner, budget = SpeculatingRunner(), SpyBudget()
    scheduler = Scheduler(max_batch=2, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    loop = DecodeLoop(runner, scheduler, FaultInjector(FaultPlan()), frozenset({15}), lambda out: None,  # type: ignore[arg-type]
                      on_fatal=lambda exc: None, prefill_budget=budget,
                      speculator=Speculator(SpeculativeConfig(num_tokens=4)))
    scheduler.submit(Sequence(request("a", 0, 20), sink=None))
    loop.step()  # the prefill: a plain step (nothing decodes, so nothing drafts)
    loop.step()  # a verify step
    assert runner.drafts_seen[0] is None and runner.drafts_seen[1] is not None
    assert budget.observed == [(0, 12)]


def test_a_verified_drafts_text_is_every_accepted_tokens_text_in_order() -> None:
    tokens, emissions, _, seqs = run([request("a", 0, 24)], Speculator(SpeculativeConfig(num_tokens=4)), text=True)
    assert any(len(e.tokens) > 1 for e in emissions)  # drafts were accepted: several tokens a step
    for e in emissions:
        assert e.text == "".join(chr(97 + t) for t in e.tokens)
    assert "".join(e.text for e in emissions) == "".join(chr(97 + t) for t in tokens["a"])


def test_a_row_count_whose_verify_steps_do_not_pay_speculates_once_in_retry_every() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=3, min_n=2, max_n=2), max_rows=2)
    seq = Sequence(request("a", 0, 10), sink=None)
    seq.generated = [2, 3]
    one, two = [seq], [seq, seq]
    assert speculator.drafts(two) == [[4, 0, 1]] * 2  # nothing measured: it speculates
    speculator.observe(2, 3, 0.030, None)  # no plain step timed at 2 rows: nothing to compare
    assert speculator.describe() == {}
    assert speculator.drafts(two) is None, "so the next step of 2 rows runs plainly, to be timed"
    assert speculator.drafts(one) == [[4, 0, 1]], "another row count as it was"
    assert speculator.drafts(two) is not None, "once"
    # 2 rows gave 3 tokens in 30 ms, where a plain step gives 2 in 20: 1.5 a row against 1 a row
    # in 1.5x the time, a payoff of exactly 1, which still speculates
    speculator.observe(2, 3, 0.030, 0.020)
    assert speculator.describe() == {2: 1.0}
    assert speculator.drafts(two) is not None
    speculator.observe(2, 2, 0.030, 0.020)  # 2 tokens in 1.5x the time: 0.667, moving 0.3 of the way
    assert speculator.describe() == {2: 0.9}
    skipped = [speculator.drafts(two) for _ in range(2 * RETRY_EVERY)]
    assert [i for i, d in enumerate(skipped) if d is not None] == [RETRY_EVERY - 1, 2 * RETRY_EVERY - 1]
    assert speculator.drafts(one) == [[4, 0, 1]]  # another row count keeps its own payoff
    sampled = Sequence(replace(seq.request, sampling=SamplingParams(temperature=0.8, seed=3)), sink=None)
    sampled.generated = [2, 3]
    # a sampled row's tokens must not hang on measured times: its steps keep the row-count rule
    assert all(speculator.drafts([seq, sampled]) is not None for _ in range(RETRY_EVERY))
    speculator.observe(2, 8, 0.030, 0.020)  # a retry that paid (2.667): 0.9 + 0.3 x 1.767
    assert speculator.describe() == {2: 1.43}
    assert all(speculator.drafts(two) is not None for _ in range(3))
    speculator.observe(1, 2, 0.030, 0.030)  # one row, 2 tokens in a plain step's time: 2.0; 3 rows: 0.667
    speculator.observe(3, 2, 0.030, 0.030)
    assert speculator.describe() == {1: 2.0, 2: 1.43, 3: 0.667}


def test_the_loop_gives_a_verify_steps_time_and_tokens_to_the_speculator() -> None:
    class SpySpeculator(Speculator):
        def __init__(self) -> None:
            super().__init__(SpeculativeConfig(num_tokens=4))
            self.observed: list[tuple[int, int, float | None]] = []

        def observe(self, rows: int, tokens: int, seconds: float, plain_seconds: float | None) -> None:
            assert 0 < seconds < 1
            self.observed.append((rows, tokens, plain_seconds))

    speculator, budget = SpySpeculator(), PrefillBudget(None, 256)
    scheduler = Scheduler(max_batch=2, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    loop = DecodeLoop(SpeculatingRunner(), scheduler, FaultInjector(FaultPlan()), frozenset({15}),  # type: ignore[arg-type]
                      lambda out: None, on_fatal=lambda exc: None, prefill_budget=budget, speculator=speculator)
    scheduler.submit(Sequence(request("a", 0, 20), sink=None))
    loop.step()  # the prefill: not a verify step
    loop.step()  # a verify step of one row: its draft of 4 and the token after it
    assert speculator.observed == [(1, 5, None)]  # no plain step at 1 row timed yet
    budget.observe(1, [], 0.004)
    loop.step()
    assert speculator.observed[1] == (1, 5, 0.004)
    loop.step()
    assert runner_drafts(loop)[-1] is not None and len(speculator.observed) == 3
    scheduler.submit(Sequence(request("b", 1, 20), sink=None))
    loop.step()  # b's prompt prefills: greedy "a" decodes plainly beside it
    assert runner_drafts(loop)[-1] is None and len(speculator.observed) == 3


def test_a_row_count_never_timed_plainly_runs_one_plain_step_and_then_weighs_its_verify_steps() -> None:
    speculator, budget = Speculator(SpeculativeConfig(num_tokens=4)), PrefillBudget(None, 256)
    scheduler = Scheduler(max_batch=2, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    loop = DecodeLoop(SpeculatingRunner(), scheduler, FaultInjector(FaultPlan()), frozenset({15}),  # type: ignore[arg-type]
                      lambda out: None, on_fatal=lambda exc: None, prefill_budget=budget, speculator=speculator)
    scheduler.submit(Sequence(request("a", 0, 40), sink=None))
    loop.step()  # the prefill
    loop.step()  # a verify step of one row: no plain one-row step timed to weigh it against
    assert runner_drafts(loop)[-1] is not None and budget.plain_seconds(1) is None and speculator.describe() == {}
    loop.step()  # so this one runs plainly, and the budget times it
    assert runner_drafts(loop)[-1] is None and budget.plain_seconds(1) is not None
    loop.step()  # and the next verify step is weighed
    assert runner_drafts(loop)[-1] is not None and set(speculator.describe()) == {1}


def test_a_sampled_row_verifying_beside_a_prompt_chunk_teaches_the_speculator_nothing() -> None:
    class SpySpeculator(Speculator):
        def __init__(self) -> None:
            super().__init__(SpeculativeConfig(num_tokens=4))
            self.observed = 0

        def observe(self, rows: int, tokens: int, seconds: float, plain_seconds: float | None) -> None:
            self.observed += 1

    speculator = SpySpeculator()
    scheduler = Scheduler(max_batch=2, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    loop = DecodeLoop(SpeculatingRunner(), scheduler, FaultInjector(FaultPlan()), frozenset({15}),  # type: ignore[arg-type]
                      lambda out: None, on_fatal=lambda exc: None, prefill_budget=PrefillBudget(None, 256),
                      speculator=speculator)
    sampled = request("a", 0, 20)  # sharp enough to sample the model's own text, whose lookup drafts
    scheduler.submit(Sequence(replace(sampled, sampling=SamplingParams(temperature=0.05, seed=3)), sink=None))
    loop.step()  # the prefill
    scheduler.submit(Sequence(request("b", 1, 20), sink=None))
    loop.step()  # "a" verifies while b's prompt prefills: its time is not the verify's alone
    assert runner_drafts(loop)[-1] is not None and speculator.observed == 0


def test_a_verify_step_logs_its_rows_tokens_time_and_the_payoffs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_module, "time", Clock())  # every timed step takes STEP_SECONDS
    log = Recorder()
    monkeypatch.setattr(loop_module, "log", log)
    budget = PrefillBudget(None, 256)
    budget.observe(1, [], 0.004)  # a plain one-row step: 4 ms
    scheduler = Scheduler(max_batch=2, max_context=256, queue_capacity=4, queue_retry_seconds=0.5,
                          prefill_token_budget=1024)
    loop = DecodeLoop(SpeculatingRunner(), scheduler, FaultInjector(FaultPlan()), frozenset({15}),  # type: ignore[arg-type]
                      lambda out: None, on_fatal=lambda exc: None, prefill_budget=budget,
                      speculator=Speculator(SpeculativeConfig(num_tokens=4)))
    scheduler.submit(Sequence(request("a", 0, 20), sink=None))
    loop.step()  # the prefill
    loop.step()  # a verify step: 5 tokens in 12.34 ms where a plain step gives 1 in 4: 5 x 4 / 12.34
    assert [c for c in log.calls if c[1] == "verify_step"] == [
        ("debug", "verify_step", {"rows": 1, "tokens": 5, "ms": 12.3, "payoff": {1: 1.621}})]


def runner_drafts(loop: DecodeLoop) -> list[list[list[int]] | None]:
    return loop.runner.drafts_seen  # type: ignore[attr-defined]
