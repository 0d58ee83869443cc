"""A bug in a request handler answers INTERNAL with a generic message, never UNKNOWN with the
exception's text, and the engine goes on serving (in-process server on port 0)."""

from __future__ import annotations

import grpc
import pytest
from grpc_status import rpc_status

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service import requests as engine_requests
from engine_service.config import EngineConfig, ServerConfig
from engine_service.runtime.build import build_engine
from engine_service.transport.engine_slot import EngineSlot
from engine_service.transport.server import create_server
from shared.errors import InternalError, from_rpc_error


@pytest.fixture
async def served():
    engine = await build_engine(EngineConfig(model="tiny", max_batch=2, max_context=128, max_new_tokens_limit=64))
    running = await create_server(EngineSlot.holding(engine), ServerConfig(port=0))
    await running.server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)
    engine.stop()
    await running.server.stop(0)


async def test_unexpected_exception_is_internal_with_a_generic_message(served, monkeypatch):
    real_parse = engine_requests.Request.parse

    def buggy(msg, *args, **kwargs):  # type: ignore[no-untyped-def]
        if msg.request_id == "bug":
            raise KeyError("secret internal detail")
        return real_parse(msg, *args, **kwargs)

    monkeypatch.setattr(engine_requests.Request, "parse", buggy)
    call = served.Decode(pb.DecodeRequest(request_id="bug", prompt_text="x", max_new_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    err = caught.value
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in err.details() and "bug" in err.details()
    domain = from_rpc_error(err)
    assert isinstance(domain, InternalError) and domain.metadata == {"requestId": "bug"}
    assert rpc_status.from_call(err) is not None
    # the next request is served normally
    tokens = [t async for r in served.Decode(pb.DecodeRequest(prompt_text="x", max_new_tokens=3, ignore_eos=True))
              for t in r.token_ids]
    assert len(tokens) == 3
