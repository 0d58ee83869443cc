"""The policy with replicas: UNAVAILABLE / ENGINE_DRAINING before the first token is retried at once
when a replica serves, the sweep waits for health only when none does, a stream cut mid-way is
failed and never retried; each request's replica (`peer`) and each point's `requests.by_replica`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from bench_client.config import PolicyConfig, WorkloadConfig
from bench_client.point import PointRunner, PointSpec, RequestResult, SweepStopped
from bench_client.records import by_replica
from bench_client.server_api import Chunk, DecodeSpec, ServerInfo
from bench_client.sweep import SweepEnd
from shared.errors import EngineDraining, EngineError, EngineUnavailable
from tests.bench_helpers import run_in_process, sweep_raw

INFO = ServerInfo(model="fake", max_context_tokens=512, max_new_tokens_limit=64, max_batch_size=4, queue_capacity=8,
                  vocab_size=100, eos_token_id=2, bos_token_id=1, device="cpu", dtype="float32", tokenizer="none",
                  engine_version="0")
SPEC = PointSpec(context_tokens=4, max_new_tokens=2, concurrency=1, request_rate=float("inf"))


def unavailable() -> EngineError:
    err = EngineUnavailable("connection reset")
    err.status_code = grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    return err


class FakeStream:
    def __init__(self, replica: str, tokens: int, error: EngineError | None) -> None:
        self.replica: str | None = None
        self._answer = (replica, tokens, error)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        replica, tokens, error = self._answer
        self.replica = replica
        for i in range(tokens):
            last = i == tokens - 1 and error is None
            yield Chunk(received_at=time.perf_counter(), num_tokens=1, text="", finish_reason="LENGTH" if last else None,
                        prompt_tokens=4 if last else None, completion_tokens=tokens if last else None, timing=None)
        if error is not None:
            raise error


class FakeClient:
    """Answers attempt k with script[k]: (replica, tokens streamed, error or None)."""

    target = "ipv4:a,b"

    def __init__(self, script: list[tuple[str, int, EngineError | None]]) -> None:
        self.script = script
        self.calls = 0

    def decode(self, spec: DecodeSpec, *, timeout: float, attributes: object = None) -> FakeStream:
        replica, tokens, error = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return FakeStream(replica, tokens, error)


class FakeHealth:
    def __init__(self, serving: bool) -> None:
        self.serving, self.asked = serving, 0

    async def wait_until_serving(self, timeout: float) -> bool:
        self.asked += 1
        return self.serving


class Quiet:
    def request_started(self, spec: PointSpec) -> None:
        """Nothing to show."""

    def request_finished(self, spec: PointSpec, outcome: RequestResult) -> None:
        """Nothing to record."""


def runner(client: FakeClient, health: FakeHealth) -> PointRunner:
    return PointRunner(client, INFO, WorkloadConfig((4,), (2,), (1,), requests_per_point=1, warmup_requests=0,
                                                        prompt_format="token_ids"),  # type: ignore[arg-type]
                       PolicyConfig(health_wait_s=5.0), health, Quiet(), "run")


@pytest.mark.parametrize("error", [EngineDraining.build(30.0, retry_delay=5.0), unavailable()])
def test_before_the_first_token_retries_at_once_on_a_serving_replica(error: EngineError) -> None:
    client, health = FakeClient([("a:1", 0, error), ("b:2", 2, None)]), FakeHealth(serving=True)
    started = time.monotonic()
    outcome = asyncio.run(runner(client, health).run(SPEC))
    [request] = outcome.requests
    assert request.ok and request.attempts == 2 and request.replica == "b:2"
    assert outcome.retries == 1 and health.asked == 1
    assert time.monotonic() - started < 1.0  # not the RetryInfo delay of 5 s: another replica serves


def test_with_no_replica_serving_the_sweep_stops_after_waiting() -> None:
    client, health = FakeClient([("a:1", 0, unavailable())]), FakeHealth(serving=False)
    with pytest.raises(SweepStopped, match="health_wait_s=5"):
        asyncio.run(runner(client, health).run(SPEC))
    assert health.asked == 1


@pytest.mark.parametrize("error", [EngineDraining.build(1.0), unavailable()])
def test_a_stream_cut_mid_way_is_failed_never_retried(error: EngineError) -> None:
    client, health = FakeClient([("a:1", 1, error), ("b:2", 2, None)]), FakeHealth(serving=True)
    outcome = asyncio.run(runner(client, health).run(SPEC))
    [request] = outcome.requests
    assert not request.ok and request.attempts == 1 and request.status_code == "UNAVAILABLE"
    assert request.replica == "a:1" and client.calls == 1 and health.asked == 0


def test_by_replica_counts_the_last_attempts() -> None:
    outcomes = [RequestResult(i, False, 1, None, replica=r) for i, r in enumerate(["b:2", "a:1", "b:2", None])]
    assert by_replica(outcomes) == {"a:1": 1, "b:2": 2, "none": 1}


async def test_detail_names_the_replica_of_each_request(start_engine, tmp_path: Path) -> None:
    first, second = start_engine("--model", "tiny"), start_engine("--model", "tiny")
    raw = sweep_raw(f"ipv4:{first.address},{second.address}", concurrency=[2], requests_per_point=12,
                    max_new_tokens=[4])
    result, results = await run_in_process(raw, tmp_path / "out", detail=True)
    assert result.end is SweepEnd.COMPLETED
    [record] = results.records
    by = record["requests"]["by_replica"]
    assert set(by) == {first.address, second.address} and sum(by.values()) == 12, by
    served = {first.address: first.load().requests_finished, second.address: second.load().requests_finished}
    details = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    measured = [d for d in details if not d["warmup"]]
    assert {d["peer"] for d in details} == set(by)
    assert all(by[p] <= served[p] for p in by)  # each replica did serve what it is credited with
    assert sum(1 for d in measured if d["peer"] == first.address) == by[first.address]
