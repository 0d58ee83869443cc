"""This engine's OpenAI-compatible HTTP front as a target of the bench client, beside its gRPC front:
one sweep over both (two managed tiny engines, real processes and ports), then the engine's own
refusals and failures sent through both adapters to one engine, each decided alike by the one
policy table."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench_client.config import load_config
from bench_client.openai_http import OpenAIClient
from bench_client.policy import Action, decide
from bench_client.rpc import EngineClient
from bench_client.server_api import Chunk, DecodeSpec, ServerClient
from bench_client.sweep import SweepEnd
from engine_service.config import EngineConfig, ServerConfig
from engine_service.faults import FaultPlan
from engine_service.runtime.build import build_engine
from engine_service.transport.engine_slot import EngineSlot
from engine_service.transport.metrics import EngineMetrics, disabled_meter
from engine_service.transport.server import create_server, set_health
from engine_service.transport.telemetry import RequestTelemetry
from shared.errors import (
    ContextLengthExceeded,
    EngineDraining,
    EngineError,
    EngineUnavailable,
    InvalidField,
    QueueFull,
    SequenceError,
    wire_code,
)
from tests.bench_helpers import ROOT, read_results, run_in_process
from tests.engines import EngineProcess

pytestmark = pytest.mark.timeout(90)

MAX_CONTEXT = 256
NEW_TOKENS = 8


def tiny_engine(*port_flags: str) -> list[str]:
    return ["{python}", "-m", "engine_service", "--model", "tiny", "--host", "127.0.0.1", *port_flags,
            "--threads", "1", "--max-context", str(MAX_CONTEXT), "--log-text"]


def logged(log: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


async def test_one_sweep_over_both_fronts_serves_and_refuses_alike(tmp_path: Path) -> None:
    # HTTP first: its /tokenize sizes the prompts, which the gRPC front then gets as they are
    raw = {
        "servers": {
            "engine-http": {"api": "openai", "command": tiny_engine("--port", "0", "--http-port", "{port}"),
                            "startup_timeout_s": 60.0, "drain_timeout_s": 15.0},
            "engine-grpc": {"command": tiny_engine("--port", "{port}"), "startup_timeout_s": 60.0,
                            "drain_timeout_s": 15.0},
        },
        # 300 tokens + BOS + 8 > 256: refused by each front
        "workload": {"context_tokens": [24, 300], "max_new_tokens": [NEW_TOKENS], "concurrency": [2],
                     "requests_per_point": 4, "warmup_requests": 1},
        "policy": {"health_wait_s": 10.0, "request_timeout_s": 30.0},
    }
    out = tmp_path / "out"
    result, _ = await run_in_process(raw, out, detail=True)
    assert result.end is SweepEnd.COMPLETED, result.message
    records = {(r["server"], r["context_tokens"]): r for r in read_results(out)}
    assert len(records) == 4
    http, grpc_ = records["engine-http", 24], records["engine-grpc", 24]
    assert (http["api"], grpc_["api"]) == ("openai", "engine.v1")
    assert http["target"].startswith("http://127.0.0.1:") and not grpc_["target"].startswith("http")
    assert (http["tokenizer"], grpc_["tokenizer"]) == (f"the tokenize endpoint of {http['target']}",
                                                       f"the tokenize endpoint of {grpc_['target']}")
    # what /v1/models said: the model and its context
    assert (http["server_info"]["model"], http["server_info"]["max_context_tokens"]) == ("tiny", MAX_CONTEXT)
    for point in (http, grpc_):
        assert point["status"] == "ok" and point["requests"]["completed"] == 4 and point["requests"]["failed"] == 0
        assert point["metrics"]["output_token_source"] == {"usage": 4}  # the server's own counts
    assert http["metrics"]["total_output_tokens"] == grpc_["metrics"]["total_output_tokens"] == 4 * NEW_TOKENS
    assert http["metrics"]["total_input_tokens"] == grpc_["metrics"]["total_input_tokens"] == 4 * 25  # + BOS
    detail = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    counts = {(d["server"], d["index"], d["warmup"]): d["usage_completion_tokens"] for d in detail}
    assert {k[1:]: v for k, v in counts.items() if k[0] == "engine-http"} == \
           {k[1:]: v for k, v in counts.items() if k[0] == "engine-grpc"}

    # Both engines saw each request under the sweep's id (X-Request-Id over HTTP), with the same
    # prompt, and answered it with the same text (greedy): warmup and measured requests alike.
    engines = [json.loads(line) for line in (out / "engines.jsonl").read_text().splitlines()]
    assert [(e["how"], e["exit_code"]) for e in engines] == [("drained", 0), ("drained", 0)]
    texts = []
    for engine in engines:
        seen = {e["request_id"]: (e["prompt_text"], e["output_text"])
                for e in logged(out / engine["log_file"], "request_text")}
        assert len(seen) == 5 and all(rid.startswith(result_run_id(records)) for rid in seen), seen
        texts.append(seen)
    assert texts[0] == texts[1]

    # The refusal: skipped by both, CONTEXT_LENGTH_EXCEEDED with the same numbers, each in its wire code
    refused = [records["engine-http", 300], records["engine-grpc", 300]]
    assert [(r["status"], r["reason"], r["skip_code"], r["skipped_without_sending"]) for r in refused] == [
        ("skipped", "CONTEXT_LENGTH_EXCEEDED", "HTTP_400", False),
        ("skipped", "CONTEXT_LENGTH_EXCEEDED", "INVALID_ARGUMENT", False)]
    assert refused[0]["reason_metadata"] == refused[1]["reason_metadata"] == {
        "promptTokens": "301", "maxNewTokens": str(NEW_TOKENS), "maxContextTokens": str(MAX_CONTEXT)}


def result_run_id(records: dict[tuple[str, int], dict[str, Any]]) -> str:
    (run_id,) = {r["run_id"] for r in records.values()}
    return str(run_id)


def test_the_packaged_fronts_sweep_runs_one_engine_command_over_each_front() -> None:
    config = load_config(ROOT / "bench_client" / "fronts.toml")
    grpc_, http = config.servers
    assert (grpc_.name, grpc_.api, http.name, http.api) == ("engine-grpc", "engine.v1", "engine-http", "openai")
    assert grpc_.launch is not None and http.launch is not None
    # the same engine, its defaults: only the ports differ (gRPC on any free one beside HTTP's)
    assert [p for p in http.launch.command if p not in ("0", "--http-port")] == list(grpc_.launch.command)
    assert config.workload.tokenizer == "smollm2" and config.workload.concurrency == (1, 8, 32)


# -- the engine's refusals and failures, through both adapters -------------------------------------

LONG = 8000  # tokens: a stream that outlasts the drain's grace period on any machine
FAULTS = FaultPlan(sequence_error_rate=0.5, sequence_error_seed=7)


def spec(request_id: str, *, new_tokens: int = 4, temperature: float = 0.0) -> DecodeSpec:
    return DecodeSpec(request_id=request_id, prompt_token_ids=(), prompt_text="the same prompt",
                      max_new_tokens=new_tokens, ignore_eos=True, temperature=temperature, top_p=1.0, top_k=0,
                      seed=0)


def spared(name: str) -> str:
    """A request id that `FAULTS` does not doom (its first try that is not)."""
    return next(f"{name}-{i}" for i in range(100) if not FAULTS.dooms(f"{name}-{i}"))


def doomed(name: str) -> str:
    return next(f"{name}-{i}" for i in range(100) if FAULTS.dooms(f"{name}-{i}"))


class Outcome:
    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.error: EngineError | None = None
        self.first = asyncio.Event()

    @property
    def action(self) -> Action:
        assert self.error is not None, "the call ended without an error"
        return decide(self.error, first_token_seen=bool(self.chunks))


async def call(client: ServerClient, decode: DecodeSpec, outcome: Outcome | None = None) -> Outcome:
    outcome = outcome or Outcome()
    try:
        async for chunk in client.decode(decode, timeout=60.0):
            outcome.chunks.append(chunk)
            outcome.first.set()
    except EngineError as err:
        outcome.error = err
    outcome.first.set()
    return outcome


@pytest.fixture
async def fronts() -> AsyncIterator[tuple[EngineProcess, EngineClient, OpenAIClient]]:
    engine = EngineProcess("--model", "tiny", "--http-port", "0", "--max-batch", "2", "--queue-capacity", "1",
                           "--max-context", str(LONG + 64), "--max-new-tokens", str(LONG + 64), "--grace-seconds", "2", "--queue-retry-seconds", "0.5",
                           "--fault", f"sequence-error:rate={FAULTS.sequence_error_rate},seed=7").start()
    (started,) = engine.events_named("server_started")
    grpc_client, http_client = EngineClient(engine.address), OpenAIClient(f"http://127.0.0.1:{started['http_port']}")
    try:
        yield engine, grpc_client, http_client
    finally:
        await grpc_client.close()
        await http_client.close()
        engine.kill()


async def test_the_engines_refusals_and_failures_decide_alike_over_both_fronts(
        fronts: tuple[EngineProcess, EngineClient, OpenAIClient]) -> None:
    engine, grpc_client, http_client = fronts
    clients = (grpc_client, http_client)

    # refusals before any token: the point is skipped, whichever front refused it
    bad = [await call(c, spec(spared(f"bad-{i}"), temperature=-1.0)) for i, c in enumerate(clients)]
    assert [type(o.error) for o in bad] == [InvalidField, InvalidField]
    assert [o.error.field for o in bad if o.error] == ["sampling.temperature", "temperature"]  # each front's name
    long = [await call(c, spec(spared(f"long-{i}"), new_tokens=LONG + 64)) for i, c in enumerate(clients)]
    assert [type(o.error) for o in long] == [ContextLengthExceeded, ContextLengthExceeded]
    assert long[0].error and long[1].error and long[0].error.metadata == long[1].error.metadata
    assert [o.action for o in (*bad, *long)] == [Action.SKIP_POINT] * 4
    assert [wire_code(o.error) for o in long if o.error] == ["INVALID_ARGUMENT", "HTTP_400"]

    # a sequence aborted after its first token: SEQUENCE_ABORTED (an error frame over HTTP), counted failed
    aborted = [await call(c, spec(doomed(f"abort-{i}"), new_tokens=16)) for i, c in enumerate(clients)]
    assert [type(o.error) for o in aborted] == [SequenceError, SequenceError]
    assert all(o.chunks and o.action is Action.COUNT_FAILED for o in aborted), [(o.chunks, o.error) for o in aborted]
    assert [o.error.metadata["generatedTokens"] for o in aborted if o.error] == ["1", "1"]

    # A full engine: two long streams running (one per front), one queued; then QUEUE_FULL on each
    # front, retried after the server's delay (gRPC's RetryInfo 0.5 s, HTTP's Retry-After in whole seconds)
    running = [Outcome(), Outcome()]
    tasks = [asyncio.create_task(call(c, spec(spared(f"run-{i}"), new_tokens=LONG), running[i]))
             for i, c in enumerate(clients)]
    await asyncio.wait_for(asyncio.gather(*(o.first.wait() for o in running)), 30)
    assert all(o.chunks for o in running), [o.error for o in running]
    queued = Outcome()
    tasks.append(asyncio.create_task(call(grpc_client, spec(spared("queued"), new_tokens=LONG), queued)))
    await asyncio.to_thread(engine.wait_load, lambda load: load.waiting_requests == 1)
    full = [await call(c, spec(spared(f"full-{i}"))) for i, c in enumerate(clients)]
    assert [type(o.error) for o in full] == [QueueFull, QueueFull]
    assert [o.error.retry_delay for o in full if o.error] == [0.5, 1.0]
    assert [o.action for o in full] == [Action.RETRY_AFTER_BACKOFF] * 2

    # The drain: new work is refused ENGINE_DRAINING on each front (wait for health, then retry);
    # the streams still running at the grace period's end are cut ENGINE_DRAINING (counted failed)
    engine.signal(signal.SIGTERM)
    await wait_draining(http_client.base_url)
    late = [await call(c, spec(spared(f"late-{i}"))) for i, c in enumerate(clients)]
    # gRPC: the engine's ENGINE_DRAINING, or EngineUnavailable where the channel's own health check
    # saw NOT_SERVING first and refused the call itself (a race; 1 run in 6 here): the same action
    assert type(late[0].error) in (EngineDraining, EngineUnavailable) and type(late[1].error) is EngineDraining
    assert [o.action for o in late] == [Action.WAIT_FOR_HEALTH_THEN_RETRY] * 2
    assert late[1].error is not None and late[1].error.retry_delay == 1.0  # Retry-After: 1
    assert [wire_code(o.error) for o in late if o.error] == ["UNAVAILABLE", "HTTP_503"]
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [type(o.error) for o in running] == [EngineDraining, EngineDraining]
    assert all(0 < sum(c.num_tokens for c in o.chunks) < LONG for o in running)
    assert [o.action for o in running] == [Action.COUNT_FAILED] * 2
    assert await asyncio.to_thread(engine.wait, 30) == 0


async def wait_draining(base_url: str, timeout: float = 10.0) -> None:
    """Until GET /health says the engine drains (503 "draining")."""
    async with aiohttp.ClientSession() as session:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            async with session.get(base_url + "/health") as response:
                body = await response.json()
            if response.status == 503 and body == {"status": "draining"}:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{base_url}/health did not say draining within {timeout} s: "
                                     f"{response.status} {body}")
            await asyncio.sleep(0.02)


# -- a token and the failure after it, delivered together ----------------------------------------

async def test_the_tokens_that_come_with_a_failure_reach_the_caller_on_both_fronts() -> None:
    """The engine joins what a stream has not yet taken: a token and the failure of the step after
    it can come as one update (a busy event loop). The gRPC front sends the token, then ABORTED; the
    HTTP front must as well: the token as a chunk of a 200 stream, then the error frame (it dropped
    the token and answered 500 before). The loop is held still while the decode thread produces
    both, as a busy machine holds it."""
    engine = await build_engine(EngineConfig(model="tiny", max_batch=2, max_context=256, faults=FAULTS))
    slot = EngineSlot.holding(engine)
    telemetry = RequestTelemetry(EngineMetrics(disabled_meter(), slot.load, slot.waiting))
    running = await create_server(slot, ServerConfig(port=0, http_port=0), telemetry)
    await running.server.start()
    await set_health(running, 1)  # SERVING
    clients: tuple[ServerClient, ...] = (EngineClient(f"127.0.0.1:{running.port}"),
                                         OpenAIClient(f"http://127.0.0.1:{running.http_port}"))
    try:
        for i, client in enumerate(clients):
            outcome = await held_while_it_fails(engine, client, f"joined-{i}")
            assert type(outcome.error) is SequenceError, (client.target, outcome.error)
            assert outcome.error.metadata["generatedTokens"] == "1"
            assert [c.num_tokens for c in outcome.chunks] == [1], (client.target, outcome.chunks)
            assert outcome.action is Action.COUNT_FAILED
        assert clients[1].target.startswith("http") and wire_code(outcome.error) == "HTTP_500"
    finally:
        for client in clients:
            await client.close()
        engine.stop()
        await running.stop(0)


async def held_while_it_fails(engine: Any, client: ServerClient, name: str) -> Outcome:
    """A doomed request whose first token and failure queue up together: the front's own call to
    `engine.submit` holds the event loop (0.3 s) once the engine has the request, so the decode
    thread produces both before the front takes either. Held there, not from a poll of the load:
    a tiny model's doomed request lives ~2 ms, less than one busy loop turn (CI missed it 10 times
    in 10 on the HTTP front)."""
    submit = engine.submit

    def submit_then_hold(*args: Any, **kwargs: Any) -> Any:
        handle = submit(*args, **kwargs)
        time.sleep(0.3)  # the loop held, as a busy machine holds it
        return handle

    engine.submit = submit_then_hold
    try:
        return await asyncio.wait_for(call(client, spec(doomed(name), new_tokens=16)), 30)
    finally:
        del engine.submit  # the class's own method again
