"""The sweep runner: every point of the grid, for every server and engine configuration, recorded once.

For each server of the configuration, in the order given, and each of its engine configurations
(one unmanaged target, or each combination of its grid) it starts the server if it manages one,
runs the points not yet recorded in context order, records each as it ends, and drains the server.
One server runs at a time, so that none competes with another for the CPU; every server gets the
same prompts at the same point (prompts.py). The server's API picks the adapter: engine.v1 over
gRPC (rpc.py) or OpenAI-compatible HTTP (openai_http.py); nothing here knows either protocol.
With a [preview], the first server that has points to run is first asked the preview's chat
question, and the answer is printed as it streams. Points the server already refused with
CONTEXT_LENGTH_EXCEEDED (same max_new_tokens, a smaller or equal context) are recorded skipped
without sending. A stop request (SIGTERM) lets the current point finish, then drains and returns.
Recovery is the policy table's (policy.py): this module only does what it answers.

Prompts (workload.py) are built before each point's clock starts and kept for the sweep, so every
server gets the same ones. The tokenizer that sizes and counts them is the workload's (`tokenizer`),
else the first server's own tokenize endpoint; the `prompt_tokenizer` event says which, and each
record names it. With `[search]`, the searched key's points are the probes of an SLO search
(slo_search.py), run until the search ends; recorded probes are not run again.

Traces: the sweep is one trace. Its root span `bench.sweep` has a child `bench.point` per point
recorded (skipped ones included, with their reason), and each point's Decode calls are CLIENT
spans under it (rpc.py), continued by the engine. With tracing off the spans are no-ops.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import sys
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from bench_client import records
from bench_client.chat import Question, ask
from bench_client.config import CONCURRENCY, RANDOM, TOKEN_IDS, PreviewConfig, SweepConfig, SweepServerConfig
from bench_client.config_fields import ConfigError
from bench_client.datasets import DatasetError
from bench_client.engine_process import EngineExit, EngineStartError, ManagedEngine, engine_configurations
from bench_client.openai_http import OpenAIClient
from bench_client.point import PointRunner, PointSkipped, PointSpec, RequestResult, SweepStopped
from bench_client.policy import Action, decide_preview, decide_server_info
from bench_client.progress import SweepProgress
from bench_client.results import PointKey, ResultsDir, engine_key, rate_to_json
from bench_client.rpc import EngineClient
from bench_client.server_api import ENGINE_V1, NoTokenizeEndpoint, ServerClient, ServerInfo
from bench_client.slo_search import Probe, SearchResult, next_probe, result_of
from bench_client.tokenizer import PromptTokenizer, ServerTokenizer, load_tokenizer
from bench_client.workload import NoVocabulary, PointPrompts
from shared.errors import ContextLengthExceeded, EngineError, wire_code
from shared.tracing import record_skip

log = structlog.get_logger()
tracer = trace.get_tracer("bench_client")

CONTEXT_LENGTH_EXCEEDED = ContextLengthExceeded.reason


class SweepEnd(enum.Enum):
    COMPLETED = "completed"  # every point is recorded
    STOPPED = "stopped"  # the policy stopped the sweep (engine down, credentials): resumable
    INTERRUPTED = "interrupted"  # a stop was requested (SIGTERM): resumable


@dataclass(frozen=True)
class SweepResult:
    end: SweepEnd
    message: str
    recorded: int  # points recorded by this run


@dataclass(frozen=True)
class _KnownSkip:
    context_tokens: int
    reason_metadata: dict[str, str]
    message: str


def grid_points(config: SweepConfig) -> list[PointSpec]:
    """The points of one engine configuration, smallest context first (so skips propagate). With a
    [search], the searched key takes one placeholder value (`search.high`): each such point is the
    base of one search, whose probes replace its value."""
    w = config.workload
    rates: tuple[float, ...] = w.request_rate
    concurrency: tuple[int, ...] = w.concurrency
    if config.search is not None:
        if config.search.over == CONCURRENCY:
            concurrency = (int(config.search.high),)
        else:
            rates = (config.search.high,)
    return [PointSpec(c, n, x, r, prefix_tokens=w.prefix_tokens, prefix_groups=w.prefix_groups)
            for c, n, x, r in itertools.product(sorted(w.context_tokens), w.max_new_tokens, concurrency, rates)]


def probe_spec(base: PointSpec, over: str, value: float) -> PointSpec:
    """The point of one search probe: `base` with its searched key set to `value`."""
    if over == CONCURRENCY:
        return dataclasses.replace(base, concurrency=int(value))
    return dataclasses.replace(base, request_rate=value)


def open_workload(config: SweepConfig) -> tuple[PointPrompts, PromptTokenizer | None]:
    """The sweep's prompt builder and its named tokenizer (None: the servers' own), checked before any
    request: ConfigError names the tokenizer or the dataset file that cannot be used."""
    w = config.workload
    tokenizer = load_tokenizer(w.tokenizer, base_dir=Path.cwd()) if w.tokenizer is not None else None
    prompts = PointPrompts(w)
    try:
        prompts.check()
    except DatasetError as err:
        raise ConfigError(str(err)) from err
    return prompts, tokenizer


class _Observer:
    """Feeds the progress display and, with --detail, requests.jsonl."""

    def __init__(self, progress: SweepProgress, results: ResultsDir, engine: dict[str, Any] | None,
                 run_id: str, server: str) -> None:
        self.progress, self.results, self.engine, self.run_id, self.server = progress, results, engine, run_id, server

    def request_started(self, spec: PointSpec) -> None:
        self.progress.request_started(spec)

    def request_finished(self, spec: PointSpec, outcome: RequestResult) -> None:
        self.progress.request_finished(spec, outcome)
        self.results.append_request(records.request_record(spec, outcome, engine=self.engine, run_id=self.run_id,
                                                           server=self.server))


class _UnmanagedHealth:
    def __init__(self, client: ServerClient) -> None:
        self.client = client

    async def wait_until_serving(self, timeout: float) -> bool:
        return await self.client.wait_until_serving(timeout)


class SweepRunner:
    def __init__(self, config: SweepConfig, results: ResultsDir, progress: SweepProgress,
                 workload: tuple[PointPrompts, PromptTokenizer | None] | None = None) -> None:
        self.config = config
        self.results = results
        self.progress = progress
        self._prompts, self._tokenizer = workload or open_workload(config)
        # (server and engine configuration, base point, result), for the sweep's summary
        self.search_results: list[tuple[str, PointSpec, SearchResult]] = []
        self.run_id = uuid.uuid4().hex[:8]
        self._stop_requested = False
        self._recorded = 0
        self._previewed = False
        # (server, engine key) -> max_new_tokens -> the smallest context the server refused
        self._known_skips: dict[tuple[str, str], dict[int, _KnownSkip]] = {}
        for record in results.records:
            if record["status"] == "skipped" and record["reason"] == CONTEXT_LENGTH_EXCEEDED:
                self._learn_skip((record.get("server") or "", engine_key(record["engine"])), record["max_new_tokens"],
                                 record["context_tokens"], record["reason_metadata"], record["message"])

    @property
    def recorded(self) -> int:
        """Points recorded by this run so far."""
        return self._recorded

    def request_stop(self) -> None:
        """Finish the current point, record it, drain the engine, and return INTERRUPTED."""
        if not self._stop_requested:
            log.warning("sweep_stop_requested", run_id=self.run_id)
        self._stop_requested = True

    async def run(self) -> SweepResult:
        # A new root: a sweep is one trace of its own, whatever the caller's context.
        with tracer.start_as_current_span("bench.sweep", context=otel_context.Context(),
                                          attributes={"bench.run_id": self.run_id}) as span:
            result = await self._run_sweep(span)
            span.set_attributes({"bench.sweep.end": result.end.value, "bench.sweep.recorded": result.recorded})
            if result.end is SweepEnd.STOPPED:
                span.set_status(Status(StatusCode.ERROR, result.message))
            return result

    async def _run_sweep(self, span: trace.Span) -> SweepResult:
        runs = [(server, engine) for server in self.config.servers
                for engine in (engine_configurations(server.launch) if server.launch is not None else [None])]
        points = grid_points(self.config)
        total = len(runs) * len(points) * (self.config.search.steps if self.config.search else 1)
        keys = {self._key(server, e, p) for server, e in runs for p in points}
        done = sum(1 for record in self.results.records if self.config.search or PointKey.of_record(record) in keys)
        span.set_attributes({"bench.sweep.points": total, "bench.sweep.already_recorded": done})
        self.progress.sweep_started(total, done)
        try:
            for server, engine in runs:
                todo = [p for p in points if self._to_run(server, engine, p)]
                if todo and not self._stop_requested:
                    await self._run_server(server, engine, todo)
        except (SweepStopped, EngineStartError) as stop:
            log.error("sweep_stopped", run_id=self.run_id, message=str(stop), recorded=self._recorded,
                      results=str(self.results.path))
            return SweepResult(SweepEnd.STOPPED, str(stop), self._recorded)
        self._searches_from_records(runs, points)
        if self._stop_requested:
            log.warning("sweep_interrupted", run_id=self.run_id, recorded=self._recorded)
            return SweepResult(SweepEnd.INTERRUPTED, "stopped on request; run again with --resume",
                               self._recorded)
        log.info("sweep_done", run_id=self.run_id, recorded=self._recorded, points=total)
        return SweepResult(SweepEnd.COMPLETED, "every point is recorded", self._recorded)

    def _client(self, server: SweepServerConfig, target: str) -> ServerClient:
        """The adapter of the server's API for one target."""
        if server.api == ENGINE_V1:
            return EngineClient(target, self.config.security)
        return OpenAIClient(target, self.config.security, concurrency=max(self.config.workload.concurrency),
                            vocab_size=server.vocab_size, model=server.model)

    async def _run_server(self, server: SweepServerConfig, engine: dict[str, Any] | None, todo: list[PointSpec]) -> None:
        async with AsyncExitStack() as stack:
            if server.launch is None or engine is None:
                client = self._client(server, server.target)
                stack.push_async_callback(client.close)
                health: Any = _UnmanagedHealth(client)
                if not await client.wait_until_serving(self.config.policy.health_wait_s):
                    raise SweepStopped(f"the server at {server.target} was not SERVING within "
                                       f"policy.health_wait_s={self.config.policy.health_wait_s:g} s")
            else:
                index = len(list((self.results.path).glob("engine-*.log")))
                managed = ManagedEngine(server.launch, engine, self.results.path / f"engine-{index}.log",
                                        on_exit=self._engine_exited, api=server.api,
                                        make_client=lambda target: self._client(server, target))
                stack.push_async_callback(managed.close)
                await managed.start()  # EngineStartError propagates: the configuration is unusable
                stack.push_async_callback(managed.stop)
                client = self._client(server, managed.target)
                stack.push_async_callback(client.close)
                health = managed
            server_info = await self._server_info(client, health)
            if self.config.preview is not None and not self._previewed:
                self._previewed = True
                await self._preview(client, server_info, self.config.preview)
            runner = PointRunner(client, server_info, self.config.workload, self.config.policy, health,
                                 _Observer(self.progress, self.results, engine, self.run_id, server.name), self.run_id,
                                 prompts=self._prompts, tokenizer=self._tokenizer_for(client))
            for spec in todo:
                if self._stop_requested:
                    return
                if self.config.search is None:
                    await self._run_point(runner, spec, server, engine, client.target, server_info)
                else:
                    await self._run_search(runner, spec, server, engine, client.target, server_info)

    def _searches_from_records(self, runs: list[tuple[SweepServerConfig, dict[str, Any] | None]],
                               points: list[PointSpec]) -> None:
        """The answers of the searches that an earlier run finished (this run had nothing to probe)."""
        search = self.config.search
        if search is None:
            return
        found = {(name, base) for name, base, _ in self.search_results}
        for server, engine in runs:
            for base in points:
                probes, pending = self._recorded_probes(server, engine, base)
                if pending is None and probes and (_label(server, engine), base) not in found:
                    self.search_results.append((_label(server, engine), base, result_of(search, probes)))

    def _tokenizer_for(self, client: ServerClient) -> PromptTokenizer | None:
        """The workload's tokenizer, else the server's own where text has to be sized or counted."""
        w = self.config.workload
        if self._tokenizer is not None:
            tokenizer: PromptTokenizer | None = self._tokenizer
        elif w.prompt_format == TOKEN_IDS and w.dataset == RANDOM:
            tokenizer = None  # ids need no tokenizer; answers without usage are counted by their events
        else:
            tokenizer = ServerTokenizer(client, name=f"the tokenize endpoint of {client.target}")
        log.info("prompt_tokenizer", tokenizer=tokenizer.name if tokenizer else None, dataset=w.dataset,
                 prompt_format=w.prompt_format, endpoint=w.endpoint, target=client.target)
        return tokenizer

    def _to_run(self, server: SweepServerConfig, engine: dict[str, Any] | None, spec: PointSpec) -> bool:
        """Whether `spec` (a point, or a search's base) still has a point to run for this server."""
        if self.config.search is None:
            return self._key(server, engine, spec) not in self.results.done
        return self._recorded_probes(server, engine, spec)[1] is not None

    def _recorded_probes(self, server: SweepServerConfig, engine: dict[str, Any] | None,
                         base: PointSpec) -> tuple[list[Probe], float | None]:
        """The search's probes replayed from the records, and the first value not recorded (None: done)."""
        search = self.config.search
        assert search is not None
        by_key = {PointKey.of_record(r): r for r in self.results.records}
        probes: list[Probe] = []
        while (value := next_probe(search, probes)) is not None:
            record = by_key.get(self._key(server, engine, probe_spec(base, search.over, value)))
            if record is None:
                return probes, value
            probes.append(Probe(value, _attainment(record)))
        return probes, None

    async def _run_search(self, runner: PointRunner, base: PointSpec, server: SweepServerConfig,
                          engine: dict[str, Any] | None, target: str, server_info: ServerInfo) -> None:
        search = self.config.search
        assert search is not None
        while True:
            probes, value = self._recorded_probes(server, engine, base)
            if value is None or self._stop_requested:
                break
            spec = probe_spec(base, search.over, value)
            await self._run_point(runner, spec, server, engine, target, server_info,
                                  search={"over": search.over, "step": len(probes) + 1, "low": search.low,
                                          "high": search.high, "attainment": search.attainment})
        if value is None:
            result = result_of(search, probes)
            self.search_results.append((_label(server, engine), base, result))
            log.info("slo_search_done", server=server.name, point=base.tag(), over=search.over, best=result.best,
                     first_miss=result.first_miss, probes=result.probes, attainment=search.attainment,
                     slo=self.config.slo.as_dict() if self.config.slo else None)

    async def _server_info(self, client: ServerClient, health: Any) -> ServerInfo:
        """What the server says about itself; the policy decides what a failure to ask means."""
        for attempt in (1, 2):
            try:
                return await self._ask_server_info(client)
            except EngineError as err:
                if attempt == 2 or decide_server_info(err) is Action.STOP_SWEEP:
                    raise SweepStopped(f"asking {client.target} about itself failed: {wire_code(err)} "
                                       f"{err.reason} ({err.message})") from err
            if not await health.wait_until_serving(self.config.policy.health_wait_s):
                raise SweepStopped(f"the server at {client.target} was not SERVING within "
                                   f"policy.health_wait_s={self.config.policy.health_wait_s:g} s")
        raise AssertionError("unreachable: the second attempt returns or raises")

    @staticmethod
    async def _ask_server_info(client: ServerClient) -> ServerInfo:
        try:
            return await client.server_info()
        except ValueError as err:  # the server does not say what the sweep needs (its vocabulary)
            raise SweepStopped(str(err)) from err

    async def _preview(self, client: ServerClient, server_info: ServerInfo, preview: PreviewConfig) -> None:
        """Ask the preview question and print the answer as it streams. A refusal (a model without
        a chat template) or a failure is logged and the sweep goes on: no point depends on it."""
        question = Question(preview.question, system=preview.system, max_new_tokens=preview.max_new_tokens,
                            seed=self.config.workload.seed)
        print(f"Question to {server_info.model} ({server_info.dtype}): {preview.question}\nAnswer: ", end="",
              flush=True)
        try:
            answer = await ask(client, question, timeout=self.config.policy.request_timeout_s, out=sys.stdout)
        except EngineError as err:
            print(f"(none: {wire_code(err)} {err.reason}: {err.message})\n", flush=True)
            if decide_preview(err) is Action.STOP_SWEEP:
                raise SweepStopped(f"the preview question failed: {wire_code(err)} {err.reason} ({err.message}); "
                                   "no request can succeed until that is fixed") from err
            log.warning("preview_failed", code=wire_code(err), reason=err.reason, message=err.message)
            return
        print(flush=True)  # a blank line between the answer and the sweep
        log.info("preview_answered", finish_reason=answer.finish_reason, completion_tokens=answer.completion_tokens)

    async def _run_point(self, runner: PointRunner, spec: PointSpec, server: SweepServerConfig,
                         engine: dict[str, Any] | None, target: str, server_info: ServerInfo,
                         search: dict[str, Any] | None = None) -> None:
        with tracer.start_as_current_span("bench.point", attributes=_point_attributes(spec, server, engine,
                                                                                       target)) as span:
            record = await self._point_record(runner, spec, server, engine, target, server_info,
                                              {**self._workload_fields(runner), "search": search})
            span.set_attributes({"bench.point.status": record["status"],
                                 "bench.point.requests.completed": record["requests"]["completed"],
                                 "bench.point.requests.failed": record["requests"]["failed"],
                                 "bench.point.requests.retries": record["requests"]["retries"]})
            if record["status"] == "skipped":
                record_skip(span, record["reason"], record["reason_metadata"])
                span.set_attribute("bench.point.skipped_without_sending", record["skipped_without_sending"])
            elif record["status"] == "failed":
                span.set_status(Status(StatusCode.ERROR, f"{record['reason']}: {record['requests']['failed']} of "
                                                         f"{record['requests']['sent']} requests failed"))
            self._record(record)

    def _workload_fields(self, runner: PointRunner) -> dict[str, Any]:
        """The workload's keys every record carries (results.py)."""
        w = self.config.workload
        return {"dataset": w.dataset, "endpoint": w.endpoint, "prompt_format": w.prompt_format,
                "tokenizer": runner.tokenizer.name if runner.tokenizer is not None else None,
                "range_ratio": w.range_ratio, "burstiness": w.burstiness, "duration_s": w.duration_s,
                "slo": self.config.slo.as_dict() if self.config.slo is not None else None}

    async def _point_record(self, runner: PointRunner, spec: PointSpec, server: SweepServerConfig,
                            engine: dict[str, Any] | None, target: str, server_info: ServerInfo,
                            workload: dict[str, Any]) -> dict[str, Any]:
        """Run the point (or skip it) and build its record."""
        started_at = time.time()
        common = {"engine": engine, "target": target, "server_info": server_info, "run_id": self.run_id,
                  "started_at": started_at, "server": server.name, "api": server.api, "workload": workload}
        skips_key = (server.name, engine_key(engine))
        known = self._known_skips.get(skips_key, {}).get(spec.max_new_tokens)
        if known is not None and spec.context_tokens >= known.context_tokens:
            # the refusal's metadata, restated for this point: its own prompt length, the same limits
            metadata = {**known.reason_metadata, "promptTokens": str(spec.context_tokens)}
            return records.skipped_record(
                spec, **common, reason=CONTEXT_LENGTH_EXCEEDED, reason_metadata=metadata,
                message=f"not sent: context {known.context_tokens} with max_new_tokens {spec.max_new_tokens} "
                        f"was refused ({known.message})", without_sending=True)
        self.progress.point_started(spec, engine)
        try:
            outcome = await runner.run(spec)
        except NoTokenizeEndpoint as err:
            raise SweepStopped(f"the prompts need a tokenizer and {target} has no tokenize endpoint ({err}): name "
                               "one with workload.tokenizer (a tokenizer.json, a checkpoint folder, a .gguf file or "
                               "\"smollm2\")") from err
        except (NoVocabulary, DatasetError) as err:
            raise SweepStopped(str(err)) from err
        except PointSkipped as skip:
            err = skip.error
            reason = err.reason or wire_code(err)
            if isinstance(err, ContextLengthExceeded):
                self._learn_skip(skips_key, spec.max_new_tokens, spec.context_tokens, err.metadata, err.message)
            return records.skipped_record(spec, **common, reason=reason, reason_metadata=err.metadata,
                                          message=err.message, without_sending=False, sent=1, code=wire_code(err))
        return records.point_record(outcome, **common, warmup=self.config.workload.warmup_requests,
                                    max_error_rate=self.config.policy.max_error_rate,
                                    percentiles=self.config.workload.percentiles, slo=self.config.slo)

    def _record(self, record: dict[str, Any]) -> None:
        self.results.append_point(record)
        self._recorded += 1
        self.progress.point_recorded(record)

    def _learn_skip(self, key: tuple[str, str], max_new_tokens: int, context_tokens: int, metadata: dict[str, str],
                    message: str) -> None:
        by_new = self._known_skips.setdefault(key, {})
        if max_new_tokens not in by_new or context_tokens < by_new[max_new_tokens].context_tokens:
            by_new[max_new_tokens] = _KnownSkip(context_tokens, dict(metadata), message)

    def _engine_exited(self, exit_: EngineExit) -> None:
        self.results.append_engine(exit_.as_record())

    def _key(self, server: SweepServerConfig, engine: dict[str, Any] | None, spec: PointSpec) -> PointKey:
        return PointKey(engine_key(engine), spec.context_tokens, spec.max_new_tokens, spec.concurrency,
                        spec.request_rate, spec.prefix_tokens, spec.prefix_groups, server=server.name)


def _label(server: SweepServerConfig, engine: dict[str, Any] | None) -> str:
    """A server and engine configuration as the summary names them ("" for one unnamed server)."""
    settings = ",".join(f"{k}={v}" for k, v in sorted((engine or {}).items()))
    return " ".join(part for part in (server.name, settings) if part)


def _attainment(record: dict[str, Any]) -> float:
    """A recorded probe's SLO attainment (0 for a skipped point, or one without it)."""
    metrics = record.get("metrics") or {}
    value = metrics.get("slo_attainment")
    return float(value) if isinstance(value, (int, float)) else 0.0


def _point_attributes(spec: PointSpec, server: SweepServerConfig, engine: dict[str, Any] | None,
                      target: str) -> dict[str, Any]:
    """The point's parameters, its server and engine configuration, as span attributes."""
    return {
        "bench.server": server.name,
        "bench.server.api": server.api,
        "bench.point.context_tokens": spec.context_tokens,
        "bench.point.max_new_tokens": spec.max_new_tokens,
        "bench.point.concurrency": spec.concurrency,
        "bench.point.request_rate": rate_to_json(spec.request_rate),  # requests/s, or "inf"
        "bench.point.prefix_tokens": spec.prefix_tokens,
        "bench.point.prefix_groups": spec.prefix_groups,
        "gen_ai.request.max_tokens": spec.max_new_tokens,
        "bench.target": target,
        **{f"bench.engine.{key}": value for key, value in (engine or {}).items()},
    }
