"""One point of the sweep: its requests at a concurrency and arrival rate, each request handled
by the policy table.

The point's requests (workload.py: built before its clock starts) start as a gamma process of
`request_rate` with shape `burstiness` (1: Poisson, vLLM's arrivals; all at once when the rate is
inf) and at most `concurrency` of them are in flight (a request keeps its slot while it backs off).
With `duration_s`, no request starts once that many seconds passed since the first one: the point
ends when those in flight end (the others are not sent, and not counted). Warmup requests run
first, at the same concurrency, and are not measured.

Prompts: with `prefix_tokens` > 0, request i of a point starts with the shared prefix of group
i % prefix_groups. Warmup request i uses group i % prefix_groups too, as vLLM's benchmark warms up
on the measured distribution: with warmup_requests >= prefix_groups every prefix is in the engine's
prefix cache before the measured requests start (capacity allowing), so a point measures the
steady state of shared system prompts.

Output tokens: the server's usage where it reports it; where it does not, the answer's text is
counted by the sweep's tokenizer after the request ended (never on its clock) — metrics.py.

A request that ends with finish_reason LENGTH before max_new_tokens, with no error, was cut short by
the server (llama-server stops a request at its slot's context): it is `truncated`, counted with the
failed requests under TRUNCATED, never measured as a success.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from bench_client.config import PolicyConfig, WorkloadConfig
from bench_client.metrics import Arrival, RequestTimeline
from bench_client.point_spec import PointSpec
from bench_client.policy import Action, backoff_delay, decide, decide_server_info
from bench_client.server_api import Chunk, DecodeSpec, NoTokenizeEndpoint, ServerClient, ServerInfo
from bench_client.tokenizer import PromptTokenizer
from bench_client.workload import PointPrompts, PointRequest
from shared.errors import EngineError, wire_code

__all__ = ["PointSpec"]  # re-exported: the point's key, read with its outcome

log = structlog.get_logger()


@dataclass(frozen=True)
class RequestResult:
    index: int
    warmup: bool
    attempts: int
    timeline: RequestTimeline | None  # set when the request succeeded
    sent_at_unix: float = 0.0  # when the last attempt was sent (wall clock)
    status_code: str | None = None  # the gRPC code name of a failed request
    reason: str | None = None
    message: str = ""
    replica: str | None = None  # the replica that answered the last attempt (None: none was reached)
    truncated: bool = False  # the server ended it early without an error (timeline kept, not measured)

    @property
    def ok(self) -> bool:
        return self.timeline is not None and not self.truncated


@dataclass(frozen=True)
class PointOutcome:
    spec: PointSpec
    requests: tuple[RequestResult, ...]  # the measured ones
    duration_s: float
    retries: int
    connection_resends: int = 0  # requests the adapter sent again on a fresh connection (not retries)


class PointSkipped(Exception):
    """The engine said this point cannot run as asked (policy SKIP_POINT)."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(f"point skipped: {error.reason or wire_code(error)}: {error.message}")
        self.error = error


class SweepStopped(Exception):
    """No point can run now (policy STOP_SWEEP, or the engine stayed down); the sweep stops, resumable."""


class HealthGate(Protocol):
    async def wait_until_serving(self, timeout: float) -> bool: ...


class PointObserver(Protocol):
    def request_started(self, spec: PointSpec) -> None: ...

    def request_finished(self, spec: PointSpec, outcome: RequestResult) -> None: ...


class PointRunner:
    def __init__(self, client: ServerClient, server_info: ServerInfo, workload: WorkloadConfig,
                 policy: PolicyConfig, health: HealthGate, observer: PointObserver, run_id: str, *,
                 prompts: PointPrompts | None = None, tokenizer: PromptTokenizer | None = None) -> None:
        self.client = client
        self.server_info = server_info
        self.workload = workload
        self.policy = policy
        self.health = health
        self.observer = observer
        self.run_id = run_id
        self.prompts = prompts or PointPrompts(workload)
        self.tokenizer = tokenizer  # sizes text prompts and counts answers that come without usage
        self._rng = random.Random(workload.seed)  # backoff jitter only

    async def run(self, spec: PointSpec) -> PointOutcome:
        """Warm up, then run the measured requests; raises PointSkipped or SweepStopped."""
        warmup = await self._requests(spec, warmup=True, count=self.workload.warmup_requests)
        measured = await self._requests(spec, warmup=False, count=self.workload.requests_per_point)
        if warmup:
            await self._run_batch(spec, warmup, rate=math.inf, warmup=True)
        resends = _resends(self.client)
        started = time.perf_counter()
        outcomes = await self._run_batch(spec, measured, rate=spec.request_rate, warmup=False,
                                         duration_s=self.workload.duration_s)
        duration = time.perf_counter() - started
        retries = sum(o.attempts - 1 for o in outcomes)
        return PointOutcome(spec=spec, requests=tuple(outcomes), duration_s=duration, retries=retries,
                            connection_resends=_resends(self.client) - resends)

    async def _requests(self, spec: PointSpec, *, warmup: bool, count: int) -> list[PointRequest]:
        """The point's prompts. Sizing them may ask the server's tokenize endpoint: a failure there is
        judged as a failed GetServerInfo is (policy.decide_server_info): wait for health and ask
        once more, else stop the sweep, resumable."""
        if not count:
            return []
        for attempt in (1, 2):
            try:
                return await self.prompts.requests(spec, warmup=warmup, count=count, tokenizer=self.tokenizer,
                                                   server_info=self.server_info)
            except EngineError as err:
                if attempt == 2 or decide_server_info(err) is Action.STOP_SWEEP:
                    raise SweepStopped(f"sizing the prompts of point {spec.tag()} with {self.client.target}'s "
                                       f"tokenize endpoint failed: {wire_code(err)} {err.reason} ({err.message})"
                                       ) from err
            if not await self.health.wait_until_serving(self.policy.health_wait_s):
                raise SweepStopped(f"the server at {self.client.target} was not SERVING within "
                                   f"policy.health_wait_s={self.policy.health_wait_s:g} s while the prompts of "
                                   f"point {spec.tag()} were sized")
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _run_batch(self, spec: PointSpec, requests: Sequence[PointRequest], *, rate: float, warmup: bool,
                         duration_s: float | None = None) -> list[RequestResult]:
        slots = asyncio.Semaphore(spec.concurrency)
        offsets = arrival_offsets(len(requests), rate, random.Random(f"{self.workload.seed}:{spec.tag()}"),
                                  burstiness=self.workload.burstiness)
        started = time.perf_counter()
        deadline = started + duration_s if duration_s is not None else math.inf

        async def one(request: PointRequest, offset: float) -> RequestResult | None:
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                if time.perf_counter() >= deadline:
                    return None  # the point's time is up: not sent
                return await self._request(spec, request, warmup)

        tasks = [asyncio.create_task(one(r, off)) for r, off in zip(requests, offsets, strict=True)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()  # only the unfinished ones: a skip or stop ends the whole batch
            await asyncio.wait(tasks)
        _raise_first_error(tasks)
        return [outcome for task in tasks if (outcome := task.result()) is not None]

    async def _request(self, spec: PointSpec, request: PointRequest, warmup: bool) -> RequestResult:
        index = request.index
        self.observer.request_started(spec)
        attempt = 0
        while True:
            attempt += 1
            decode = DecodeSpec(
                request_id=f"{self.run_id}-{spec.tag()}-{'w' if warmup else 'm'}{index}-a{attempt}",
                prompt_token_ids=request.token_ids, prompt_text=request.text, messages=request.messages,
                max_new_tokens=request.max_new_tokens, ignore_eos=self.workload.ignore_eos,
                temperature=self.workload.temperature, top_p=self.workload.top_p, top_k=self.workload.top_k,
                seed=self.workload.seed + index,
            )
            chunks: list[Chunk] = []
            sent_at_unix, sent_at = time.time(), time.perf_counter()
            stream = self.client.decode(decode, timeout=self.policy.request_timeout_s, attributes={
                "bench.request.index": index, "bench.request.attempt": attempt, "bench.request.warmup": warmup})
            try:
                async for chunk in stream:
                    chunks.append(chunk)
            except EngineError as err:
                outcome = await self._after_error(spec, err, index, warmup, attempt, bool(chunks), stream.replica)
                if outcome is None:
                    continue
            else:
                outcome = _success(index, warmup, attempt, sent_at, chunks, request.prompt_tokens,
                                   request.max_new_tokens, await self._text_tokens(chunks))
            outcome = dataclasses.replace(outcome, sent_at_unix=sent_at_unix, replica=stream.replica)
            self.observer.request_finished(spec, outcome)
            return outcome

    async def _after_error(self, spec: PointSpec, err: EngineError, index: int, warmup: bool, attempt: int,
                           streamed: bool, replica: str | None) -> RequestResult | None:
        """Apply the policy to one failed call: None means "retry", else the request's final outcome."""
        action = decide(err, first_token_seen=streamed)
        code = wire_code(err)
        failed = RequestResult(index=index, warmup=warmup, attempts=attempt, timeline=None, status_code=code,
                                reason=err.reason or None, message=err.message)
        if action is Action.SKIP_POINT:
            raise PointSkipped(err)
        if action is Action.STOP_SWEEP:
            raise SweepStopped(f"the server answered {code} {err.reason or ''} ({err.message}); "
                               "no request can succeed until that is fixed")
        if action is Action.COUNT_FAILED:
            return failed
        if attempt >= self.policy.max_attempts:
            log.warning("request_gave_up", point=spec.tag(), index=index, code=code, reason=err.reason,
                        attempts=attempt)
            return failed
        if action is Action.RETRY_AFTER_BACKOFF:
            delay = backoff_delay(attempt, server_delay=err.retry_delay, initial=self.policy.backoff_initial_s,
                                  maximum=self.policy.backoff_max_s, rng=self._rng)
            log.debug("request_backoff", point=spec.tag(), index=index, code=code, reason=err.reason,
                      delay_s=round(delay, 4), attempt=attempt)
            await asyncio.sleep(delay)
            return None
        if action is Action.WAIT_FOR_HEALTH_THEN_RETRY:
            # One health check through the target's channel answers SERVING at once while any replica
            # serves (round_robin picks a healthy one): then retry now, there. Else poll, bounded.
            log.warning("engine_unavailable", point=spec.tag(), index=index, code=code, reason=err.reason,
                        message=err.message, replica=replica, wait_s=self.policy.health_wait_s)
            if not await self.health.wait_until_serving(self.policy.health_wait_s):
                raise SweepStopped(f"the server at {self.client.target} was not SERVING within "
                                   f"policy.health_wait_s={self.policy.health_wait_s:g} s after {code} "
                                   f"({err.message})")
            return None
        raise AssertionError(f"policy action {action!r} has no handler")  # a client bug: crash


    async def _text_tokens(self, chunks: Sequence[Chunk]) -> int | None:
        """The answer's text counted by the sweep's tokenizer, where the server sent no usage count."""
        if not chunks or chunks[-1].completion_tokens is not None or self.tokenizer is None:
            return None
        try:
            return len(await self.tokenizer.encode("".join(c.text for c in chunks)))
        except (EngineError, NoTokenizeEndpoint):
            # The server's tokenize endpoint failed after its answer came whole: the answer stands, and
            # is counted by its events instead (the record's output_token_source says "stream").
            return None


def _resends(client: ServerClient) -> int:
    """The adapter's count of requests sent again after a dead pooled connection (HTTP only)."""
    return int(getattr(client, "stale_connection_resends", 0))


def arrival_offsets(count: int, rate: float, rng: random.Random, *, burstiness: float = 1.0) -> list[float]:
    """Start offsets (s) of `count` requests: gaps drawn from a gamma distribution of shape
    `burstiness` and mean 1/rate (vLLM's: 1 is a Poisson process, smaller is burstier); all 0 when
    rate is inf."""
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        # burstiness 1 is the exponential: drawn as such, so a Poisson sweep keeps the arrivals it had
        now += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


TRUNCATED = "TRUNCATED"  # the code and reason of a request the server cut short without an error


def _success(index: int, warmup: bool, attempts: int, sent_at: float, chunks: Sequence[Chunk],
             prompt_tokens: int, max_new_tokens: int, text_tokens: int | None = None) -> RequestResult:
    last = chunks[-1] if chunks else None
    if last is None or last.finish_reason is None:
        # The stream ended cleanly without its final message: a contract violation, counted as failed.
        return RequestResult(index=index, warmup=warmup, attempts=attempts, timeline=None, status_code="OK",
                              reason="STREAM_ENDED_WITHOUT_FINISH",
                              message=f"the stream ended after {len(chunks)} messages without finish_reason")
    timeline = RequestTimeline(
        sent_at=sent_at,
        arrivals=tuple(Arrival(c.received_at, c.num_tokens) for c in chunks),
        prompt_tokens=last.prompt_tokens if last.prompt_tokens else prompt_tokens,
        engine_queue_s=last.timing.queue_seconds if last.timing else None,
        engine_ttft_s=last.timing.time_to_first_token_seconds if last.timing else None,
        cached_prompt_tokens=last.cached_prompt_tokens or 0,
        usage_completion_tokens=last.completion_tokens,
        server_timings=dict(last.server_timings) if last.server_timings else None,
        text_tokens=text_tokens,
    )
    produced = timeline.output_tokens
    if last.finish_reason == "LENGTH" and produced < max_new_tokens:
        return RequestResult(index=index, warmup=warmup, attempts=attempts, timeline=timeline, truncated=True,
                              status_code=TRUNCATED, reason=TRUNCATED,
                              message=f"the server ended the answer after {produced} of max_new_tokens "
                                      f"{max_new_tokens} tokens with finish_reason LENGTH and no error "
                                      "(a full context: llama-server's `truncated`)")
    return RequestResult(index=index, warmup=warmup, attempts=attempts, timeline=timeline)


def _raise_first_error(tasks: Sequence[asyncio.Task[RequestResult]]) -> None:
    """Re-raise what ended a batch: a client bug first, then a stop, then a skip."""
    errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    for kind in (None, SweepStopped, PointSkipped):
        for error in errors:
            if kind is None and not isinstance(error, (SweepStopped, PointSkipped)):
                raise error  # type: ignore[misc]
            if kind is not None and isinstance(error, kind):
                raise error
