"""The policy table against a real engine, in process: QUEUE_FULL flood, aborted sequences,
credentials, two replicas behind round_robin, skip propagation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from bench_client import records
from bench_client.rpc import EngineClient
from bench_client.server_api import DecodeSpec
from bench_client.sweep import SweepEnd
from tests.bench_helpers import point_counts, read_results, run_in_process, sweep_raw


async def test_queue_full_flood_is_retried_after_backoff(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--max-batch", "1", "--queue-capacity", "1",
                          "--queue-retry-seconds", "0.02")
    raw = sweep_raw(engine.address, concurrency=[8], requests_per_point=16, max_new_tokens=[8],
                    policy={"max_attempts": 100, "backoff_initial_s": 0.01, "backoff_max_s": 0.05})
    result, results = await run_in_process(raw, tmp_path / "out", detail=True)
    assert result.end is SweepEnd.COMPLETED
    [record] = results.records
    assert record["status"] == "ok"
    assert record["requests"]["completed"] == 16 and record["requests"]["failed"] == 0
    assert record["requests"]["retries"] > 0  # QUEUE_FULL happened and was retried
    details = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert len(details) == 16 and max(d["attempts"] for d in details) > 1


async def test_queue_full_after_bounded_attempts_is_counted(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--max-batch", "1", "--queue-capacity", "1",
                          "--queue-retry-seconds", "0.01")
    raw = sweep_raw(engine.address, concurrency=[8], requests_per_point=8, max_new_tokens=[16],
                    policy={"max_attempts": 1, "max_error_rate": 0.0})
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED
    [record] = results.records
    assert record["status"] == "failed" and record["reason"] == "ERROR_RATE_EXCEEDED"
    assert record["requests"]["failed_by_code"]["RESOURCE_EXHAUSTED"] >= 1
    assert record["requests"]["failed_by_reason"]["QUEUE_FULL"] >= 1
    assert record["metrics"]["completed"] == record["requests"]["completed"] >= 1


async def test_aborted_sequences_are_counted_by_code(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--fault", "sequence-error:rate=0.5,seed=3")
    raw = sweep_raw(engine.address, concurrency=[4], requests_per_point=12, policy={"max_error_rate": 0.1})
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED
    [record] = results.records
    failed = record["requests"]["failed"]
    assert failed >= 1 and record["requests"]["failed_by_code"] == {"ABORTED": failed}
    assert record["status"] == "failed"
    assert record["metrics"]["completed"] == 12 - failed  # failed requests are not in the latencies


async def test_unauthenticated_stops_the_sweep(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", env={"ENGINE_AUTH_TOKEN": "s3cret"})
    with pytest.raises(grpc.RpcError) as caught:
        engine.load()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    raw = sweep_raw(engine.address, context_tokens=[16, 32])
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.STOPPED
    assert "UNAUTHENTICATED" in result.message
    assert results.records == []


async def test_two_replicas_both_serve_with_round_robin(start_engine, tmp_path: Path) -> None:
    first = start_engine("--model", "tiny")
    second = start_engine("--model", "tiny")
    target = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
    raw = sweep_raw(target, concurrency=[2], requests_per_point=16, max_new_tokens=[4])
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED
    assert results.records[0]["requests"]["completed"] == 16
    served = [first.load().requests_finished, second.load().requests_finished]
    assert all(n > 0 for n in served), served
    assert sum(served) == 16


async def test_context_length_exceeded_skips_larger_points_without_sending(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--max-context", "128")
    raw = sweep_raw(engine.address, context_tokens=[200, 16, 150], max_new_tokens=[8, 100], concurrency=[1, 2],
                    requests_per_point=2)
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED
    by_point = {(r["context_tokens"], r["max_new_tokens"], r["concurrency"]): r for r in results.records}
    assert len(by_point) == 12 and set(point_counts(results.records).values()) == {1}
    assert by_point[16, 8, 1]["status"] == by_point[16, 8, 2]["status"] == "ok"
    # 16 + 100 fits in 128; the first refusal for max_new_tokens=100 is context 150
    assert by_point[16, 100, 1]["status"] == "ok"
    sent = by_point[150, 8, 1]
    assert sent["status"] == "skipped" and sent["reason"] == "CONTEXT_LENGTH_EXCEEDED"
    assert sent["reason_metadata"]["maxContextTokens"] == "128" and not sent["skipped_without_sending"]
    for key in [(150, 8, 2), (200, 8, 1), (200, 8, 2), (150, 100, 2), (200, 100, 1), (200, 100, 2)]:
        assert by_point[key]["status"] == "skipped" and by_point[key]["skipped_without_sending"], key
        assert by_point[key]["reason"] == "CONTEXT_LENGTH_EXCEEDED"
        meta = by_point[key]["reason_metadata"]  # this point's figures, not those of the refused one
        assert (meta["promptTokens"], meta["maxNewTokens"], meta["maxContextTokens"]) == (
            str(key[0]), str(key[1]), "128"), meta
    # nothing was sent for the propagated skips: 2 ok points x 2 requests x 3 + the two refused requests
    assert engine.load().requests_finished <= 3 * 2 * 2 + 2 + 2  # (+2: any concurrent request of a refused point)


@pytest.mark.parametrize("rate", [50.0])
async def test_poisson_rate_point(start_engine, tmp_path: Path, rate: float) -> None:
    engine = start_engine("--model", "tiny")
    raw = sweep_raw(engine.address, concurrency=[4], requests_per_point=10, request_rate=[rate])
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED
    [record] = results.records
    assert record["request_rate"] == rate and record["status"] == "ok"
    assert record["metrics"]["completed"] == 10


async def test_a_client_bug_crashes_and_leaves_results_resumable(start_engine, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    engine = start_engine("--model", "tiny")
    raw = sweep_raw(engine.address, context_tokens=[8, 16, 24], requests_per_point=2)
    real = records.point_record
    calls = []

    def buggy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise TypeError("a bug in the client")
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "point_record", buggy)
    with pytest.raises(TypeError, match="a bug in the client"):  # no blanket catch swallowed it
        await run_in_process(raw, tmp_path / "out")
    monkeypatch.setattr(records, "point_record", real)
    first = read_results(tmp_path / "out")
    assert [r["context_tokens"] for r in first] == [8]
    result, results = await run_in_process(raw, tmp_path / "out", resume=True)
    assert result.end is SweepEnd.COMPLETED
    assert sorted(r["context_tokens"] for r in results.records) == [8, 16, 24]


async def test_own_cancellation_is_never_a_received_cancelled(start_engine) -> None:
    """The policy reads a received CANCELLED as "the engine's server stopped": that holds only if
    this client's own cancellations (a point's task cancelled, the channel closed) never come back
    as an EngineError. grpc.aio raises asyncio.CancelledError for them; this pins that fact."""
    engine = start_engine("--model", "tiny", "--max-context", "4096", "--max-new-tokens", "4000")
    spec = DecodeSpec(request_id="mine", prompt_token_ids=tuple(range(5, 21)), max_new_tokens=4000,
                      ignore_eos=True, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    client = EngineClient(engine.address)
    first = asyncio.Event()

    async def consume() -> None:
        async for _chunk in client.decode(spec, timeout=60):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    first.clear()
    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 30)
    await client.close()  # the channel closed under a call in flight
    with pytest.raises(asyncio.CancelledError):
        await task
    load = engine.wait_load(lambda x: x.running_sequences == 0)
    assert load.kv_cache_used_tokens == 0
