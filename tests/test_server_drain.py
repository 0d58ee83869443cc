"""`server.drain`, in-process: a stream that outlasts the grace period is cut with ENGINE_DRAINING
when the grace period ends (not later), and drain returns soon after; a stream that ends within
the grace period is not waited on any longer than it runs."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.v1 import engine_pb2 as pb
from engine_service.config import EngineConfig
from engine_service.transport.server import drain
from tests.contract import details
from tests.inprocess import served

GRACE_S = 0.4
CONFIG = EngineConfig(model="tiny", max_batch=2, max_context=8192, max_new_tokens_limit=8000)


async def read_all(call) -> tuple[list[int], grpc.aio.AioRpcError | None, float]:  # type: ignore[no-untyped-def]
    """Tokens, the error (or None) and when the stream ended."""
    tokens: list[int] = []
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens.extend(response.token_ids)
    except grpc.aio.AioRpcError as err:
        return tokens, err, time.monotonic()
    return tokens, None, time.monotonic()


async def test_drain_cuts_a_stream_at_the_end_of_the_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    async with served(CONFIG, monkeypatch) as s:
        call = s.stub.Decode(pb.DecodeRequest(request_id="outlasts", prompt_text="long", max_new_tokens=8000,
                                              ignore_eos=True))
        first = await call.read()
        reader = asyncio.create_task(read_all(call))
        started = time.monotonic()
        code = await drain(s.running, GRACE_S)
        drained_after = time.monotonic() - started
        tokens, err, ended = await reader
        assert err is not None, f"the stream completed ({len(first.token_ids) + len(tokens)} tokens)"
        got = details(err)
        assert got["code"] == grpc.StatusCode.UNAVAILABLE and got["info"].reason == "ENGINE_DRAINING"
        cut_after = ended - started
        assert GRACE_S <= cut_after < GRACE_S + 0.5, f"cut {cut_after:.2f} s into a grace period of {GRACE_S} s"
        assert code == 0 and drained_after < GRACE_S + 1.5
        assert len(tokens) < 8000 // 2


async def test_drain_waits_only_as_long_as_the_streams_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    async with served(CONFIG, monkeypatch) as s:
        call = s.stub.Decode(pb.DecodeRequest(request_id="short", prompt_text="short", max_new_tokens=300,
                                              ignore_eos=True))
        first = await call.read()
        reader = asyncio.create_task(read_all(call))
        started = time.monotonic()
        draining = asyncio.create_task(drain(s.running, 30.0))
        await asyncio.sleep(0.05)
        assert s.engine.draining
        health = await s.running.health.Check(health_pb2.HealthCheckRequest(), None)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        tokens, err, _ = await reader
        assert err is None and len(first.token_ids) + len(tokens) == 300
        assert await draining == 0
        assert time.monotonic() - started < 5.0  # the 30 s grace period was not waited out
