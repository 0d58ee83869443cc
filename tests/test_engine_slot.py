"""`EngineSlot`, in-process: while the model loads the server answers GetLoad with zeros and
health NOT_SERVING, and Decode, Tokenize and GetServerInfo wait; once the engine is in the slot
the waiting calls are answered by it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.config import EngineConfig, ServerConfig
from engine_service.runtime.build import build_engine
from engine_service.scheduling.scheduler import LoadSnapshot
from engine_service.transport.engine_slot import EngineSlot, Loading, Ready
from engine_service.transport.server import create_server

CONFIG = EngineConfig(model="tiny", max_batch=2, max_context=128, max_new_tokens_limit=64)


async def test_calls_wait_while_loading_and_are_answered_once_ready() -> None:
    slot = EngineSlot()
    running = await create_server(slot, ServerConfig(port=0))
    await running.server.start()
    engine = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load == pb.Load() and not load.draining
            health = await running.health.Check(health_pb2.HealthCheckRequest(), None)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            info = asyncio.ensure_future(stub.GetServerInfo(pb.GetServerInfoRequest()))
            tokenized = asyncio.ensure_future(stub.Tokenize(pb.TokenizeRequest(text="hi")))
            decoded = asyncio.ensure_future(_tokens(stub.Decode(pb.DecodeRequest(
                prompt_text="x", max_new_tokens=3, ignore_eos=True))))
            await asyncio.sleep(0.2)
            assert not (info.done() or tokenized.done() or decoded.done())
            assert isinstance(slot.state, Loading)

            engine = await build_engine(CONFIG)
            slot.fill(engine)
            assert slot.state == Ready(engine)
            assert (await info).model == "tiny"
            assert list((await tokenized).token_ids) == engine.loaded.tokenizer.encode("hi")
            assert len(await decoded) == 3
            assert (await stub.GetLoad(pb.GetLoadRequest())).kv_cache_capacity_tokens > 0
    finally:
        if engine is not None:
            engine.stop()
        await running.server.stop(0)


async def _tokens(call) -> list[int]:  # type: ignore[no-untyped-def]
    return [t async for r in call for t in r.token_ids]


async def test_a_loading_slot_reads_zeros_and_names_no_model() -> None:
    slot = EngineSlot()
    assert (slot.load(), slot.waiting(), slot.draining, slot.model) == (LoadSnapshot(), 0, False, None)
    with pytest.raises(RuntimeError, match="while the model loads"):
        slot.ready_engine()


async def test_a_slot_is_filled_once() -> None:
    engine = await build_engine(CONFIG)
    try:
        slot = EngineSlot.holding(engine)
        assert slot.ready_engine() is engine and await slot.engine() is engine and slot.model == "tiny"
        with pytest.raises(RuntimeError, match="already holds an engine serving 'tiny'"):
            slot.fill(engine)
    finally:
        engine.stop()
