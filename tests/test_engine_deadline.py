"""The engine's own deadline path, over gRPC: DEADLINE_EXCEEDED with its ErrorInfo (reason and
metadata), the `request_finished` event and the `engine_requests_total` metric, and the sequence
freed, with the client's deadline far longer than the engine's.

The engine learns a deadline only from the call (`context.time_remaining()`), and gRPC enforces
that same deadline on both ends of a real call: whichever fires first answers, so a test with an
ordinary client deadline cannot tell the engine's answer from gRPC's own (measured on loopback: the
engine's details reach the client in about 4 calls of 10; a defect that never expires deadlines
passes such a test). Here the server runs in-process and the servicer sees a call whose remaining
time is short (0.3 s), while the client waits 10 s: any DEADLINE_EXCEEDED is the engine's."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.v1 import engine_pb2 as pb
from engine_service.config import EngineConfig
from engine_service.transport.servicer import EngineServicer
from tests.contract import details
from tests.inprocess import served
from tests.test_observability_metrics import scrape, series

ENGINE_DEADLINE_S = 0.3
CLIENT_TIMEOUT_S = 10.0
ENGINE_DEADLINE_HEADER = "x-test-engine-deadline"


class ShortDeadline:
    """The servicer's context, except that `time_remaining()` is the test's engine deadline for
    calls that carry ENGINE_DEADLINE_HEADER (the call's own for the others)."""

    def __init__(self, context: grpc.aio.ServicerContext, seconds: float) -> None:
        self._context, self._seconds = context, seconds

    def time_remaining(self) -> float:
        return self._seconds

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._context, name)


@pytest.fixture
def engine_deadlines(monkeypatch):  # type: ignore[no-untyped-def]
    real_decode = EngineServicer.decode

    async def decode(self, raw, context):  # type: ignore[no-untyped-def]
        header = dict(context.invocation_metadata()).get(ENGINE_DEADLINE_HEADER)
        if header is not None:
            context = ShortDeadline(context, float(header))
        async for response in real_decode(self, raw, context):
            yield response

    monkeypatch.setattr(EngineServicer, "decode", decode)
    return monkeypatch


async def collect(call) -> tuple[list[int], grpc.aio.AioRpcError | None]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    try:
        async for response in call:
            tokens.extend(response.token_ids)
    except grpc.aio.AioRpcError as err:
        return tokens, err
    return tokens, None


CONFIG = EngineConfig(model="tiny", max_batch=1, max_context=4096, max_new_tokens_limit=4000, queue_capacity=4)


async def test_the_engine_expires_a_decoding_request_with_its_own_details_event_and_metric(engine_deadlines):
    async with served(CONFIG, engine_deadlines) as s:
        started = time.monotonic()
        call = s.stub.Decode(pb.DecodeRequest(request_id="expires", prompt_text="slow", max_new_tokens=4000,
                                              ignore_eos=True),
                             timeout=CLIENT_TIMEOUT_S, metadata=((ENGINE_DEADLINE_HEADER, f"{ENGINE_DEADLINE_S}"),))
        tokens, err = await collect(call)
        elapsed = time.monotonic() - started
        assert err is not None, f"the request completed ({len(tokens)} tokens): its deadline never expired"
        got = details(err)
        assert got["code"] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "info" in got, f"a DEADLINE_EXCEEDED without the engine's details (gRPC's own): {got['message']!r}"
        assert got["info"].reason == "DEADLINE_EXCEEDED" and got["info"].domain == "engine.v1"
        generated = int(got["info"].metadata["generatedTokens"])
        assert got["info"].metadata["requestId"] == "expires"
        assert 0 < len(tokens) == generated < 4000, "it was decoding, far from its end"
        assert f"after {generated} generated tokens" in got["message"]
        assert ENGINE_DEADLINE_S <= elapsed < ENGINE_DEADLINE_S + 1.0
        # freed within the step that saw the deadline: the load was published before the answer
        load = await s.stub.GetLoad(pb.GetLoadRequest())
        assert (load.running_sequences, load.kv_cache_used_tokens) == (0, 0)
        ends = s.finished("expires")
        assert len(ends) == 1
        assert ends[0]["status"] == "DEADLINE_EXCEEDED" and ends[0]["reason"] == "DEADLINE_EXCEEDED"
        assert ends[0]["output_tokens"] == generated
        samples = scrape(s.metrics.port)
        assert series(samples, "engine_requests_total", status="DEADLINE_EXCEEDED", reason="DEADLINE_EXCEEDED") == [1.0]
        assert series(samples, "engine_requests_total", status="CANCELLED") == []


async def test_the_engine_expires_a_queued_request_before_its_prefill(engine_deadlines):
    async with served(CONFIG, engine_deadlines) as s:
        blocker = s.stub.Decode(pb.DecodeRequest(request_id="blocker", prompt_text="b", max_new_tokens=4000,
                                                 ignore_eos=True))
        await blocker.read()  # decoding in the only row: what follows waits in the queue
        call = s.stub.Decode(pb.DecodeRequest(request_id="queued", prompt_text="q", max_new_tokens=10),
                             timeout=CLIENT_TIMEOUT_S, metadata=((ENGINE_DEADLINE_HEADER, f"{ENGINE_DEADLINE_S}"),))
        tokens, err = await collect(call)
        assert err is not None and tokens == []
        got = details(err)
        assert got["code"] == grpc.StatusCode.DEADLINE_EXCEEDED and "info" in got, got["message"]
        assert got["info"].reason == "DEADLINE_EXCEEDED"
        assert dict(got["info"].metadata) == {"requestId": "queued", "generatedTokens": "0"}
        load = await s.stub.GetLoad(pb.GetLoadRequest())
        assert (load.running_sequences, load.waiting_requests) == (1, 0)
        ends = s.finished("queued")
        assert len(ends) == 1 and ends[0]["status"] == "DEADLINE_EXCEEDED" and ends[0]["output_tokens"] == 0
        assert "queue_s" not in ends[0], "it was never prefilled"
        blocker.cancel()
        await asyncio.sleep(0)
