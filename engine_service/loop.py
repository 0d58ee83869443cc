"""The decode loop: its own thread, and the one place that decides recovery.

One step reads top to bottom: drop -> admit -> plan -> forward -> sample -> emit -> retire. The
forward decodes the decoding rows and prefills this step's prompt chunks together (scheduler.py).
A SequenceError aborts that one sequence and the others go on untouched. Anything else is not
understood here: it is logged as `engine_fatal` with its traceback and the process exits
non-zero (the supervisor restarts it in a known-good state). There is no retry loop.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from engine_service.faults import FaultInjector
from engine_service.model_runner import ModelRunner
from engine_service.prefill_budget import PrefillBudget
from engine_service.prefix_cache import PrefixCache
from engine_service.sampler import new_generator, sample
from engine_service.scheduler import Scheduler
from engine_service.sequence import FinishReason, Sequence
from engine_service.speculator import Speculator
from shared.errors import DeadlineExceeded, EngineError, SequenceError

log = structlog.get_logger()

FATAL_EXIT_CODE = 70  # EX_SOFTWARE
FATAL_EXIT_AFTER_SECONDS = 2.0


@dataclass(frozen=True)
class Emission:
    """What one sequence produced in one step, delivered to its stream on the event loop."""

    seq: Sequence
    tokens: tuple[int, ...]
    finish: FinishReason | None = None
    error: EngineError | None = None
    at: float = 0.0


Deliver = Callable[[list[Emission]], None]


class DecodeLoop:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, faults: FaultInjector, end_token_ids: frozenset[int],
                 deliver: Deliver, on_fatal: Callable[[BaseException], None],
                 prefix_cache: PrefixCache | None = None, prefill_budget: PrefillBudget | None = None,
                 speculator: Speculator | None = None) -> None:
        self.runner = runner
        self.speculator = speculator
        # fixed at the scheduler's own budget unless given one that adapts to the step times
        self.prefill_budget = prefill_budget or PrefillBudget(scheduler.prefill_token_budget, scheduler.max_context)
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.scheduler = scheduler
        self.faults = faults
        self.end_token_ids = end_token_ids
        self._deliver = deliver
        self._on_fatal = on_fatal
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        scheduler.publish_load(self.prefix_cache.stats())

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.scheduler.stop()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while self.scheduler.wait_for_work():
                self.step()
        except BaseException as exc:  # noqa: BLE001 - not a catch: the fatal path, which exits the process
            self._fatal(exc)

    def _fatal(self, exc: BaseException) -> None:
        log.critical("engine_fatal", error_type=type(exc).__name__, step=self.steps, exc_info=exc)
        # The event loop sets health NOT_SERVING and ends the streams; if it cannot within the
        # bound, the process exits from here anyway.
        watchdog = threading.Timer(FATAL_EXIT_AFTER_SECONDS, os._exit, (FATAL_EXIT_CODE,))
        watchdog.daemon = True
        watchdog.start()
        self._on_fatal(exc)

    def step(self) -> None:
        now = time.monotonic()
        out: list[Emission] = []
        sched, cache, prefix = self.scheduler, self.runner.cache, self.prefix_cache
        # drop: cancelled and expired sequences free their rows before anything runs
        for seq in sched.take_dropped_waiting(now):
            out.append(self._dropped(seq, now))
        for seq in sched.remove_rows(sched.rows_to_drop(now), cache.move_row):
            out.append(self._dropped(seq, now))
        # admit, and plan: the decoding rows, and prompt chunks within the prefill budget
        sched.admit()
        if not sched.running:
            sched.publish_load(prefix.stats())
            self._deliver(out)
            return
        self.steps += 1
        self.faults.before_forward(self.steps)
        decoding = sched.running[:sched.decoding]
        sched.prefill_token_budget = self.prefill_budget.tokens(len(decoding))
        prefills = sched.plan_prefill(lambda seq, row: self._start(seq, row, now))
        drafts = self.speculator.drafts(decoding) if self.speculator is not None else None
        # forward + sample: the decoding rows (with their drafts), then the prompts whose last chunk this is
        started = time.perf_counter()
        logits = self.runner.forward(decoding, prefills, drafts)
        for p in prefills:
            p.seq.cache_len = p.chunk.start + p.chunk.length
            prefix.offer(p.seq.request.prompt_ids, cache, p.chunk.row, p.seq.cache_len)
        producing = decoding + [p.seq for p in prefills if p.completes]
        tokens = self._tokens(logits, producing, drafts)
        if drafts is None:  # a verify step's time is no measure of a decode step's
            self._time_prefill(len(decoding), sum(p.chunk.length for p in prefills), time.perf_counter() - started)
        # emit: one sequence failing is that sequence's business alone
        emitted_at = time.monotonic()
        doomed = self.faults.doomed_rows(self.steps, [s.request_id for s in producing],
                                         [len(s.generated) for s in producing])
        finished: list[Sequence] = []
        for i, (seq, seq_tokens) in enumerate(zip(producing, tokens, strict=True)):
            try:
                out.append(self._emit(seq, seq_tokens, i in doomed, emitted_at))
            except SequenceError as err:
                log.warning("sequence_aborted", request_id=seq.request_id, **seq.trace, reason=err.reason,
                            cause=err.metadata.get("cause"))
                out.append(Emission(seq, (), error=err, at=emitted_at))
                finished.append(seq)
                continue
            if out[-1].finish is not None:
                finished.append(seq)
                prefix.offer(seq.request.prompt_ids + tuple(seq.generated), cache, sched.running.index(seq),
                             seq.cache_len)  # its generated blocks too, so that the next turn hits
        # retire
        sched.promote(producing[len(decoding):], cache.swap_rows)
        sched.remove_rows([sched.running.index(s) for s in finished], cache.move_row)
        sched.publish_load(prefix.stats())
        self._deliver(out)

    @staticmethod
    def _tokens(logits: torch.Tensor, producing: list[Sequence], drafts: list[list[int]] | None) -> list[list[int]]:
        """Each producing sequence's tokens this step: one sampled, or a verified draft's several."""
        if drafts is not None:
            return Speculator.choose(logits, producing, drafts)
        return [[t] for t in sample(logits, [s.request.sampling for s in producing], [s.generator for s in producing])]

    def _time_prefill(self, decoding: int, fed: int, seconds: float) -> None:
        """Give a plain step's time to the prefill budget, which adapts to it."""
        self.prefill_budget.observe(decoding, fed, seconds)
        if fed and decoding:
            log.debug("prefill_step", decoding=decoding, tokens=fed, budget=self.scheduler.prefill_token_budget,
                      ms=round(seconds * 1000, 1), **self.prefill_budget.describe())

    def _start(self, seq: Sequence, row: int, now: float) -> None:
        """A sequence's prefill begins: its generator, and the cached prefix of its prompt."""
        seq.timings.prefill_started = now
        seq.generator = new_generator(seq.request.sampling, self.runner.device)
        seq.cache_len = seq.cached_tokens = self.prefix_cache.reuse(seq.request.prompt_ids, self.runner.cache, row)

    def _emit(self, seq: Sequence, tokens: list[int], doomed: bool, at: float) -> Emission:
        """Append this step's tokens (one, or a verified draft's several) up to the first that ends it."""
        if doomed:
            raise self.faults.fail(seq.request_id, len(seq.generated), self.steps)
        finish, kept = None, []
        for token in tokens:
            seq.generated.append(token)
            kept.append(token)
            if (finish := seq.finish_reason(token, self.end_token_ids)) is not None:
                break
        seq.cache_len = seq.total_len - 1  # this step's inputs are in the cache; the newest token is not
        if seq.ngram is not None:
            seq.ngram.extend(kept)
        if seq.timings.first_token is None:
            seq.timings.first_token = at
        seq.timings.last_token = at
        return Emission(seq, tuple(kept), finish=finish, at=at)

    @staticmethod
    def _dropped(seq: Sequence, now: float) -> Emission:
        """A cancelled sequence needs no answer (its caller left); an expired one is told so."""
        error = None if seq.cancelled else DeadlineExceeded.build(seq.request_id, len(seq.generated))
        return Emission(seq, (), error=error, at=now)


def set_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)
