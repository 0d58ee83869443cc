"""Continuous batching changes no greedy result, through a fixed interleaving: the real tiny model
and KV cache driven step by step by the DecodeLoop, with sequences finishing at known steps so
that rows move (`KVCache.move_row`) while others decode, and new prompts prefill into the freed
rows behind them. Each sequence's tokens and logits must equal those of the same request run
alone. (The over-gRPC `test_batching_does_not_change_greedy_results` proves the wiring, but
whether a row moves there depends on the timing of the calls.)"""

from __future__ import annotations

import pytest
import torch

from engine_service.faults import FaultInjector, FaultPlan
from engine_service.model.loader import load_model
from engine_service.requests import Request, SamplingParams
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import DecodeLoop
from engine_service.runtime.model_runner import ModelRunner, StepLogits
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import StepPlan
from tests.step_plans import unpack

CPU = torch.device("cpu")
MAX_BATCH = 4
# (prompt, max_new_tokens), submitted in this order into 4 rows: r0 ends at step 4 and r3 moves into
# its row, r4 prefills behind the three old rows; r2 ends at step 10 and r4 moves into its row, r5
# prefills; and so on: five moves in all, each of a row that goes on decoding (the test checks them).
REQUESTS = [
    ("The first prompt", 4), ("a second, longer prompt for row one", 30), ("third", 10), ("4", 30),
    ("queued fifth prompt", 12), ("sixth", 30), ("seventh one waits the longest", 20),
]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    loaded = load_model("tiny", CPU, torch.float32)
    return ModelRunner(loaded.model, MAX_BATCH, 128, CPU, torch.float32)


class Recorder:
    """Wraps the runner: the logits each sequence got at each of its steps, and the row moves."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        self.cache = self  # the loop calls cache.move_row
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.moves: list[tuple[int, int, int]] = []

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.moves.append((src, dst, length))
        self.runner.cache.move_row(src, dst, length)

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        self.moves.append((a, b, -1))
        self.runner.cache.swap_rows(a, b, length_a, length_b)

    def forward(self, plan: StepPlan) -> StepLogits:
        decoding, prefills, drafts = unpack(plan)
        logits = self.runner.forward(plan)
        producing = decoding + [p.seq for p in prefills if p.completes]
        for row, seq in enumerate(producing):
            self.logits.setdefault(seq.request_id, []).append(logits.sampled[row].clone())
        return logits


def run(runner: ModelRunner, requests: list[tuple[str, str, int]], max_batch: int) -> tuple[dict[str, list[int]],
                                                                                           Recorder]:
    """Submit every request at once and step until all are done; tokens by request id."""
    recorder = Recorder(runner)
    scheduler = Scheduler(max_batch=max_batch, max_context=128, queue_capacity=16, queue_retry_seconds=0.5,
                          prefill_token_budget=4096)
    delivered: list[Delta] = []

    def fatal(exc: BaseException) -> None:
        raise AssertionError(f"on_fatal: {exc!r}")

    loop = DecodeLoop(recorder, scheduler, FaultInjector(FaultPlan()), frozenset(), delivered.extend,  # type: ignore[arg-type]
                      fatal)
    seqs = []
    for request_id, prompt, max_new in requests:
        request = Request(request_id=request_id, prompt_ids=tuple(prompt.encode()), max_new_tokens=max_new,
                          sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None)
        seqs.append(Sequence(request, sink=None))
        scheduler.submit(seqs[-1])
    while scheduler.rows or scheduler.waiting_count():
        loop.step()
    assert all(e.error is None for e in delivered)
    return {s.request_id: s.generated for s in seqs}, recorder


def test_rows_moved_in_the_kv_cache_decode_exactly_as_if_alone(runner: ModelRunner) -> None:
    requests = [(f"r{i}", prompt, max_new) for i, (prompt, max_new) in enumerate(REQUESTS)]
    alone: dict[str, list[int]] = {}
    alone_logits: dict[str, list[torch.Tensor]] = {}
    for request in requests:
        tokens, recorder = run(runner, [request], max_batch=MAX_BATCH)
        alone.update(tokens)
        alone_logits.update(recorder.logits)
    together, recorder = run(runner, requests, max_batch=MAX_BATCH)
    # the interleaving is fixed: these moves happen on every run
    assert recorder.moves == [(3, 0, 4), (3, 2, 24), (3, 2, 10), (3, 1, 42), (2, 0, 24)]
    for request_id, _, max_new in requests:
        assert len(together[request_id]) == max_new
        assert together[request_id] == alone[request_id], f"{request_id}: batched tokens differ from alone"
        for step, (got, want) in enumerate(zip(recorder.logits[request_id], alone_logits[request_id], strict=True)):
            assert torch.allclose(got, want, atol=1e-4), f"{request_id} step {step}: max diff {(got - want).abs().max()}"


def test_prompts_prefilled_in_chunks_while_rows_move_and_swap_decode_exactly_as_if_alone(runner: ModelRunner) -> None:
    """Chunked prefill with the rows reshuffled under it: x decodes while a, b, c prefill 8 tokens a
    step; x ends, so c (the last row) moves into x's row ahead of a and b; a completes first and is
    swapped into the first row to join the decoding rows (`KVCache.swap_rows`), then b."""
    plan = [(0, "x", "x: a short prompt", 3), (1, "a", "a prompt of forty-odd bytes for row a", 6),
            (1, "b", "b, another long prompt, prefilled after a", 6), (1, "c", "c waits behind both a and b", 5)]
    alone = {}
    for _at, request_id, prompt, max_new in plan:
        tokens, _ = run(runner, [(request_id, prompt, max_new)], max_batch=MAX_BATCH)
        alone.update(tokens)
    recorder = Recorder(runner)
    scheduler = Scheduler(max_batch=MAX_BATCH, max_context=128, queue_capacity=16, queue_retry_seconds=0.5,
                          prefill_token_budget=8)
    delivered: list[Delta] = []
    loop = DecodeLoop(recorder, scheduler, FaultInjector(FaultPlan()), frozenset(), delivered.extend,  # type: ignore[arg-type]
                      lambda exc: (_ for _ in ()).throw(AssertionError(f"on_fatal: {exc!r}")))
    seqs: dict[str, Sequence] = {}
    step = 0
    while step < 2 or scheduler.rows or scheduler.waiting_count():
        for at, request_id, prompt, max_new in plan:
            if at == step:
                seqs[request_id] = Sequence(Request(request_id=request_id, prompt_ids=tuple(prompt.encode()),
                                                    max_new_tokens=max_new, sampling=SamplingParams(),
                                                    stop_token_ids=frozenset(), ignore_eos=True, deadline=None),
                                            sink=None)
                scheduler.submit(seqs[request_id])
        loop.step()
        step += 1
    assert all(e.error is None for e in delivered)
    assert any(length == -1 for _, _, length in recorder.moves), f"no row was swapped: {recorder.moves}"
    assert {k: s.generated for k, s in seqs.items()} == alone
