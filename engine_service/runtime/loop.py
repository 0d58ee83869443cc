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
from itertools import accumulate

import structlog
import torch

from engine_service.generation.constraint import apply_masks
from engine_service.generation.logits_processors import Penalties, process
from engine_service.generation.logprobs import TokenLogprobs, token_logprobs
from engine_service.generation.sampler import new_generator, sample
from engine_service.runtime.faults import FaultInjector
from engine_service.runtime.model_runner import ModelRunner, StepLogits
from engine_service.runtime.speculator import Speculator
from engine_service.scheduling.prefill_budget import PrefillBudget
from engine_service.scheduling.prefix_cache import PrefixCache
from engine_service.scheduling.scheduler import Prefill, Scheduler
from engine_service.scheduling.sequence import FinishReason, Sequence
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
    text: str = ""  # the text these tokens release (output_text.py: stop strings hold some back)
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asks for them
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # on its first emission, with echo_prompt_logprobs


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
        for i, p in enumerate(prefills):
            p.seq.cache_len = p.chunk.start + p.chunk.length
            prefix.offer(p.seq.request.prompt_ids, cache, p.chunk.row, p.seq.cache_len)
            if i in logits.prompt:
                self._echo(p, logits.prompt[i])
        producing = decoding + [p.seq for p in prefills if p.completes]
        tokens, rows = self._tokens(logits, producing, drafts)
        if drafts is None:  # a verify step's time is no measure of a decode step's
            self._time_prefill(len(decoding), sum(p.chunk.length for p in prefills), time.perf_counter() - started)
        # emit: one sequence failing is that sequence's business alone
        emitted_at = time.monotonic()
        doomed = self.faults.doomed_rows(self.steps, [s.request_id for s in producing],
                                         [len(s.generated) for s in producing])
        finished: list[Sequence] = []
        for i, (seq, seq_tokens) in enumerate(zip(producing, tokens, strict=True)):
            try:
                out.append(self._emit(seq, seq_tokens, i in doomed, emitted_at, logits.sampled[rows[i]:]))
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

    def _tokens(self, logits: StepLogits, producing: list[Sequence],
                drafts: list[list[int]] | None) -> tuple[list[list[int]], list[int]]:
        """Each producing sequence's tokens this step (one sampled, or a verified draft's several),
        and the row of the logits its first token was chosen from (the others follow it)."""
        if drafts is None:
            return [[t] for t in self._choose(logits.sampled, producing)], list(range(len(producing)))
        rows = list(accumulate((1 + len(d) for d in drafts), initial=0))
        verified = Speculator.choose(logits.sampled, producing[:len(drafts)], drafts)
        rest = self._choose(logits.sampled[rows[-1]:], producing[len(drafts):])
        return verified + [[t] for t in rest], rows[:-1] + list(range(rows[-1], rows[-1] + len(rest)))

    @torch.inference_mode()  # the model's logits are inference tensors: changed in place only in it
    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row: the request's logit bias, min_new_tokens mask and penalties
        (logits_processors.py), its response_format's mask (constraint.py), then its sampler.
        `logits` stays raw when a row asks for log-probabilities (they are computed from it)."""
        params = [s.request.sampling for s in seqs]
        raw_needed = any(s.request.top_logprobs for s in seqs)  # else changed in place: no copy of the batch
        chosen = process(logits, params, [s.penalties for s in seqs], [len(s.generated) for s in seqs],
                         [self._banned(s) for s in seqs], in_place=not raw_needed)
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if constrained:
            chosen = apply_masks(chosen.clone() if chosen is logits and raw_needed else chosen, constrained,
                                 [seqs[i].constraint for i in constrained])
        return sample(chosen, params, [s.generator for s in seqs])

    def _banned(self, seq: Sequence) -> frozenset[int]:
        """The tokens min_new_tokens holds back while the sequence has fewer: EOS and its stop
        tokens; a constrained row's EOS stays its grammar's (once complete it allows EOS alone)."""
        if seq.request.sampling.min_new_tokens <= len(seq.generated):
            return frozenset()
        ends = self.end_token_ids if seq.constraint is None else frozenset()
        return ends | seq.request.stop_token_ids

    @staticmethod
    def _echo(prefill: Prefill, logits: torch.Tensor) -> None:
        """The log-probabilities of this chunk's prompt tokens after the first: row j of its
        logits predicts the token at chunk.start + j + 1 (the last row of the prompt's last chunk
        predicts the first generated token, which is no prompt token)."""
        seq, chunk = prefill.seq, prefill.chunk
        targets = seq.request.prompt_ids[chunk.start + 1:chunk.start + chunk.length + 1]
        seq.prompt_logprobs.extend(token_logprobs(logits, targets, seq.request.top_logprobs))

    def _time_prefill(self, decoding: int, fed: int, seconds: float) -> None:
        """Give a plain step's time to the prefill budget, which adapts to it."""
        self.prefill_budget.observe(decoding, fed, seconds)
        if fed and decoding:
            log.debug("prefill_step", decoding=decoding, tokens=fed, budget=self.scheduler.prefill_token_budget,
                      ms=round(seconds * 1000, 1), **self.prefill_budget.describe())

    def _start(self, seq: Sequence, row: int, now: float) -> None:
        """A sequence's prefill begins: its generator, and the cached prefix of its prompt."""
        request = seq.request
        seq.timings.prefill_started = now
        seq.generator = new_generator(request.sampling, self.runner.device)
        if request.sampling.penalized:
            seq.penalties = Penalties(request.prompt_ids, self.runner.model.config.vocab_size, self.runner.device)
        # a prompt whose log-probabilities are echoed is computed whole: cached positions give none
        seq.cache_len = seq.cached_tokens = 0 if request.echo_prompt_logprobs else \
            self.prefix_cache.reuse(request.prompt_ids, self.runner.cache, row)

    def _emit(self, seq: Sequence, tokens: list[int], doomed: bool, at: float, logits: torch.Tensor) -> Emission:
        """Append this step's tokens (one, or a verified draft's several) up to the first that ends
        it; `logits` are the raw rows they were chosen from, the first token's first."""
        if doomed:
            raise self.faults.fail(seq.request_id, len(seq.generated), self.steps)
        finish, kept, text = None, [], []
        for token in tokens:
            seq.generated.append(token)
            kept.append(token)
            text.append(seq.text.push(token) if seq.text is not None else "")
            if seq.constraint is not None:
                seq.constraint.consume((token,))
            if (finish := seq.finish_reason(token, self.end_token_ids)) is not None:
                if seq.text is not None:
                    text.append(seq.text.flush())
                break
        seq.cache_len = seq.total_len - 1  # this step's inputs are in the cache; the newest token is not
        if seq.ngram is not None:
            seq.ngram.extend(kept)
        if seq.penalties is not None:
            seq.penalties.add(kept)
        first = seq.timings.first_token is None
        if first:
            seq.timings.first_token = at
        seq.timings.last_token = at
        top = seq.request.top_logprobs
        return Emission(seq, tuple(kept), finish=finish, at=at, text="".join(text),
                        logprobs=tuple(token_logprobs(logits, kept, top)) if top else (),
                        prompt_logprobs=tuple(seq.prompt_logprobs) if first else ())

    @staticmethod
    def _dropped(seq: Sequence, now: float) -> Emission:
        """A cancelled sequence needs no answer (its caller left); an expired one is told so."""
        error = None if seq.cancelled else DeadlineExceeded.build(seq.request_id, len(seq.generated))
        return Emission(seq, (), error=error, at=now)


def set_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)
