"""shared.engine_channel against real engines: round_robin with client-side health checking sends
no new call to a replica that reports NOT_SERVING (here: draining after SIGTERM while it holds a
long stream) while another serves; without the health check, round_robin keeps picking it."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.transport.server import replica_name
from shared.engine_channel import SERVICE_NAME, EngineChannel, channel_options, open_engine_channel, replica_of
from shared.errors import from_rpc_error

LONG = ("--model", "tiny", "--max-context", "4096", "--max-new-tokens", "4000", "--grace-seconds", "30")


async def short_call(engine: EngineChannel, request_id: str) -> tuple[str | None, str]:
    """(replica, "OK" or "CODE/REASON") of a 2-token Decode."""
    call = engine_pb2_grpc.EngineServiceStub(engine.channel).Decode(
        pb.DecodeRequest(request_id=request_id, prompt_text="hi", max_new_tokens=2, ignore_eos=True), timeout=10)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        e = from_rpc_error(err)
        return replica_of(await call.initial_metadata()), f"{err.code().name}/{e.reason}"
    return replica_of(await call.initial_metadata()), "OK"


def test_a_not_serving_replica_gets_no_new_calls(start_engine) -> None:  # type: ignore[no-untyped-def]
    a, b = start_engine(*LONG), start_engine(*LONG)
    target = f"ipv4:{a.address},{b.address}"

    async def scenario() -> None:
        engine = open_engine_channel(target)
        unchecked = open_engine_channel(target, health_check=False)
        try:
            # both connections come up (each after its first health answer), then calls alternate
            before = [await short_call(engine, f"before-{i}") for i in range(10)]
            assert all(code == "OK" for _, code in before), before
            assert Counter(r for r, _ in before[-4:]) == {a.address: 2, b.address: 2}, before
            warm = [await short_call(unchecked, f"warm-{i}") for i in range(10)]
            assert {r for r, _ in warm[-4:]} == {a.address, b.address}, warm

            long = engine_pb2_grpc.EngineServiceStub(engine.channel).Decode(pb.DecodeRequest(
                request_id="long", prompt_text="long", max_new_tokens=3500, ignore_eos=True), timeout=120)
            await long.read()  # the first token: the stream is running on one replica
            busy = replica_of(await long.initial_metadata())
            victim, other = (a, b) if busy == a.address else (b, a)
            assert busy == victim.address
            victim.signal(signal.SIGTERM)  # drains: health NOT_SERVING, the long stream goes on
            signalled = time.monotonic()
            while victim.health(SERVICE_NAME) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() - signalled < 10, "the victim never reported NOT_SERVING"
                await asyncio.sleep(0.005)
            after = [await short_call(engine, f"after-{i}") for i in range(20)]
            elapsed = time.monotonic() - signalled
            assert after == [(other.address, "OK")] * 20, after
            assert victim.proc is not None and victim.proc.poll() is None, "the victim should still be draining"
            assert victim.load().draining
            # control: the same calls without the health check still reach the draining replica
            unchecked_answers = [await short_call(unchecked, f"unchecked-{i}") for i in range(10)]
            assert (victim.address, "UNAVAILABLE/ENGINE_DRAINING") in unchecked_answers, unchecked_answers
            print(f"20 calls in {elapsed:.2f} s after SIGTERM, none on the draining replica")
            long.cancel()
        finally:
            await engine.close()
            await unchecked.close()

    asyncio.run(scenario())


def test_health_check_config_names_the_engine_service() -> None:
    config = json.loads(dict(channel_options())["grpc.service_config"])
    assert config == {"loadBalancingConfig": [{"round_robin": {}}],
                      "healthCheckConfig": {"serviceName": "engine.v1.EngineService"}}
    assert "healthCheckConfig" not in json.loads(dict(channel_options(health_check=False))["grpc.service_config"])


@pytest.mark.parametrize(("host", "expected_host"), [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", None)])
def test_replica_name(host: str, expected_host: str | None) -> None:
    assert replica_name(host, 5) == f"{expected_host or socket.gethostname()}:5"
