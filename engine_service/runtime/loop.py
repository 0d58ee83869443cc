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
from collections.abc import Sequence as Seq

import structlog
import torch

from engine_service.faults import FaultInjector
from engine_service.generation.controls import choose
from engine_service.runtime.delta import Delta
from engine_service.runtime.model_runner import ModelRunner
from engine_service.runtime.speculator import Speculator
from engine_service.scheduling.prefill_budget import PrefillBudget
from engine_service.scheduling.prefix_cache import PrefixCache
from engine_service.scheduling.scheduler import Scheduler
from engine_service.scheduling.sequence import PromptSlice, Sequence
from engine_service.scheduling.step_plan import Prefill, StepPlan
from shared.errors import DeadlineExceeded, SequenceError

log = structlog.get_logger()

FATAL_EXIT_CODE = 70  # EX_SOFTWARE
FATAL_EXIT_AFTER_SECONDS = 2.0


Deliver = Callable[[list[Delta]], None]


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
        out: list[Delta] = []
        sched, cache, prefix = self.scheduler, self.runner.cache, self.prefix_cache
        # drop: cancelled and expired sequences free their rows before anything runs
        for seq in sched.take_dropped_waiting(now):
            out.append(self._dropped(seq, now))
        for seq in sched.drop(now, cache.move_row):
            out.append(self._dropped(seq, now))
        # admit, and plan: the decoding rows (with their drafts), and prompt chunks within the prefill budget
        sched.admit()
        if not sched.rows:
            sched.publish_load(prefix.stats())
            self._deliver(out)
            return
        self.steps += 1
        self.faults.before_forward(self.steps)
        sched.prefill_token_budget = self.prefill_budget.tokens(sched.decoding, sched.prefill_position)
        plan = sched.plan(lambda seq, row: self._start(seq, row, now),
                          self.speculator.drafts if self.speculator is not None else None)
        # forward + sample: the decoding rows, then the prompts whose last chunk this is
        started = time.perf_counter()
        logits = self.runner.forward(plan)
        for i, p in enumerate(plan.prefills):
            if not p.done:  # a layer-sliced chunk with layers still to run
                p.seq.slice = PromptSlice(p.chunk.length, *p.sublayers.resume)  # type: ignore[union-attr]
                continue
            p.seq.slice = None
            p.seq.cache_len = p.chunk.start + p.chunk.length
            prefix.offer(p.seq.request.prompt_ids, cache, p.row, p.seq.cache_len)
            if i in logits.prompt:
                self._echo(p, logits.prompt[i])
        producing = plan.producing
        tokens = self._tokens(logits.sampled, plan) if producing else []
        self._time(plan, tokens, time.perf_counter() - started, logits.decode_seconds)
        # emit: one sequence failing is that sequence's business alone
        emitted_at = time.monotonic()
        doomed = self.faults.doomed_rows(self.steps, [e.seq.request_id for e in producing],
                                         [len(e.seq.generated) for e in producing])
        finished: list[Sequence] = []
        for i, (entry, seq_tokens) in enumerate(zip(producing, tokens, strict=True)):
            seq = entry.seq
            try:
                out.append(self._emit(seq, seq_tokens, i in doomed, emitted_at, logits.sampled[entry.logits]))
            except SequenceError as err:
                log.warning("sequence_aborted", request_id=seq.request_id, **seq.trace, reason=err.reason,
                            cause=err.metadata.get("cause"))
                out.append(Delta(seq, (), error=err, at=emitted_at))
                finished.append(seq)
                continue
            if out[-1].finish is not None:
                finished.append(seq)
                prefix.offer(seq.request.prompt_ids + tuple(seq.generated), cache, entry.row,
                             seq.cache_len)  # its generated blocks too, so that the next turn hits
        # retire
        sched.retire(plan, finished, cache.swap_rows, cache.move_row)
        sched.publish_load(prefix.stats())
        self._deliver(out)

    def _tokens(self, sampled: torch.Tensor, plan: StepPlan) -> list[list[int]]:
        """Each producing entry's tokens this step: one sampled, or a verified draft's several."""
        if not plan.speculative:
            return [[t] for t in self._choose(sampled, [e.seq for e in plan.producing])]
        verified = Speculator.choose(sampled, plan.decodes)
        rest = plan.producing[len(plan.decodes):]
        drafted = plan.decodes[-1].logits.stop  # the completing prompts' rows follow the drafts'
        return verified + [[t] for t in self._choose(sampled[drafted:], [e.seq for e in rest])]

    def _choose(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """One token per row, as each sequence's controls prepare and sample it."""
        return choose(logits, [s.controls for s in seqs], [len(s.generated) for s in seqs], self.end_token_ids)

    @staticmethod
    def _echo(prefill: Prefill, logits: torch.Tensor) -> None:
        """The log-probabilities of this chunk's prompt tokens after the first: row j of its
        logits predicts the token at chunk.start + j + 1 (the last row of the prompt's last chunk
        predicts the first generated token, which is no prompt token)."""
        seq, chunk = prefill.seq, prefill.chunk
        seq.controls.echo(logits, seq.request.prompt_ids[chunk.start + 1:chunk.start + chunk.length + 1])

    def _time(self, plan: StepPlan, tokens: list[list[int]], seconds: float, decode_seconds: float | None) -> None:
        """Give a plain step's time to the prefill budget, and a verify step's (with no prompt
        chunk) to the speculator, against a plain step's; both adapt to them. A verify step's time
        is no measure of a decode step's. `decode_seconds`: a layer-sliced step's decoding rows'
        part, where the runner timed it."""
        if not plan.speculative:
            self._time_prefill(plan, seconds, decode_seconds)
        elif not plan.prefills and self.speculator is not None:
            rows, made = len(plan.decodes), sum(len(t) for t in tokens)  # no prompt completing: the rows' alone
            self.speculator.observe(rows, made, seconds, self.prefill_budget.plain_seconds(rows))
            log.debug("verify_step", rows=rows, tokens=made, ms=round(seconds * 1000, 1),
                      payoff=self.speculator.describe())

    def _time_prefill(self, plan: StepPlan, seconds: float, decode_seconds: float | None) -> None:
        """Give a plain step's time to the prefill budget, which adapts to it."""
        decoding, fed, sliced = len(plan.decodes), plan.prefill_tokens, plan.sliced
        if sliced is not None and sliced.sublayers is not None:
            span = sliced.sublayers
            self.prefill_budget.observe_slice(decoding, sliced.chunk, span, seconds, decode_seconds)
            log.debug("sliced_prefill_step", decoding=decoding, tokens=fed, position=sliced.chunk.start,
                      sublayers=[span.first, span.stop], rows=[span.first_row, span.stop_row],
                      ms=round(seconds * 1000, 1),
                      decode_part_ms=None if decode_seconds is None else round(decode_seconds * 1000, 1),
                      **self.prefill_budget.describe())
            return
        self.prefill_budget.observe(decoding, [p.chunk for p in plan.prefills], seconds)
        if fed and decoding:
            log.debug("prefill_step", decoding=decoding, tokens=fed, position=plan.prefills[0].chunk.start,
                      budget=self.scheduler.prefill_token_budget,
                      ms=round(seconds * 1000, 1), **self.prefill_budget.describe())

    def _start(self, seq: Sequence, row: int, now: float) -> None:
        """A sequence's prefill begins: its controls' generator and penalties, and the cached prefix
        of its prompt."""
        request = seq.request
        seq.timings.prefill_started = now
        seq.controls.start(self.runner.device, lambda: self.runner.model.config.vocab_size)
        # a prompt whose log-probabilities are echoed is computed whole: cached positions give none
        seq.cache_len = seq.cached_tokens = 0 if request.echo_prompt_logprobs else \
            self.prefix_cache.reuse(request.prompt_ids, self.runner.cache, row)

    def _emit(self, seq: Sequence, tokens: list[int], doomed: bool, at: float, logits: torch.Tensor) -> Delta:
        """Append this step's tokens (one, or a verified draft's several) up to the first that ends
        it; `logits` are the raw rows they were chosen from, the first token's first."""
        if doomed:
            raise self.faults.fail(seq.request_id, len(seq.generated), self.steps)
        controls = seq.controls
        finish, kept, text = None, [], []
        for token in tokens:
            seq.generated.append(token)
            kept.append(token)
            piece, finish = controls.accept(token, len(seq.generated), self.end_token_ids)
            text.append(piece)
            if finish is not None:
                break
        seq.cache_len = seq.total_len - 1  # this step's inputs are in the cache; the newest token is not
        controls.advance(kept)
        first = seq.timings.first_token is None
        if first:
            seq.timings.first_token = at
        seq.timings.last_token = at
        return Delta(seq, tuple(kept), finish=finish, at=at, text="".join(text),
                     logprobs=controls.logprobs(logits, kept),
                     prompt_logprobs=tuple(controls.prompt_logprobs) if first else ())

    @staticmethod
    def _dropped(seq: Sequence, now: float) -> Delta:
        """A cancelled sequence needs no answer (its caller left); an expired one is told so."""
        error = None if seq.cancelled else DeadlineExceeded.build(seq.request_id, len(seq.generated))
        return Delta(seq, (), error=error, at=now)


def set_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)
