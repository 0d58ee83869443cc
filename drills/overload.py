"""Overload: ten times the queue capacity of concurrent callers, each sending again as soon as
its call ends (a rejected caller waits only 20 ms, ignoring RetryInfo: the harshest client).
Every call must end OK with all its tokens, or RESOURCE_EXHAUSTED/QUEUE_FULL with RetryInfo
before any token; health stays SERVING throughout; the engine's RSS stays bounded."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drills.common import CallResult, EngineProcess, answer_of, collect, note, rss_kib
from drills.row import Checks, DrillRow
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc

NAME = "overload"
MAX_NEW = 32
CALLERS_PER_CHANNEL = 64
RSS_GROWTH_BOUND_KIB = 64 * 1024


class StormTally:
    def __init__(self) -> None:
        self.answers: Counter[str] = Counter()
        self.completed = 0
        self.rejected = 0
        self.lost: list[str] = []  # accepted (or not classified) and not completed
        self.health_polls = 0
        self.health_bad: list[str] = []
        self.peak_rss_kib = 0


async def read(call: grpc.aio.UnaryStreamCall) -> CallResult:
    tokens: list[int] = []
    try:
        async for msg in call:
            tokens.extend(msg.token_ids)
    except grpc.RpcError as err:
        return answer_of(err, tokens)
    return CallResult("OK", tokens=tuple(tokens))


async def caller(stub: engine_pb2_grpc.EngineServiceStub, index: int, until: float, tally: StormTally) -> None:
    n = 0
    while time.monotonic() < until:
        request = pb.DecodeRequest(request_id=f"c{index}-{n}", prompt_text=f"caller {index} asks {n}",
                                   max_new_tokens=MAX_NEW, ignore_eos=True)
        n += 1
        got = await read(stub.Decode(request, timeout=60))
        tally.answers[f"{got.code}/{got.reason}" if got.reason else got.code] += 1
        if got.ok and len(got.tokens) == MAX_NEW:
            tally.completed += 1
        elif got.is_("RESOURCE_EXHAUSTED", "QUEUE_FULL") and (got.retry_delay or 0) > 0 and not got.tokens:
            tally.rejected += 1
            await asyncio.sleep(0.02)
        else:
            tally.lost.append(f"{request.request_id}: {got.short()} after {len(got.tokens)} tokens")


async def watch(address: str, pid: int, until: float, tally: StormTally) -> None:
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < until:
            tally.peak_rss_kib = max(tally.peak_rss_kib, rss_kib(pid))
            try:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            except grpc.RpcError as err:
                tally.health_bad.append(answer_of(err).short())
            else:
                if status != health_pb2.HealthCheckResponse.SERVING:
                    tally.health_bad.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            tally.health_polls += 1
            await asyncio.sleep(0.1)


async def storm(address: str, pid: int, callers: int, seconds: float) -> StormTally:
    tally = StormTally()
    until = time.monotonic() + seconds
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(-(-callers // CALLERS_PER_CHANNEL))]
    try:
        stubs = [engine_pb2_grpc.EngineServiceStub(ch) for ch in channels]
        await asyncio.gather(watch(address, pid, until, tally),
                             *(caller(stubs[i // CALLERS_PER_CHANNEL], i, until, tally) for i in range(callers)))
    finally:
        for ch in channels:
            await ch.close()
    return tally


def run(quick: bool) -> DrillRow:
    capacity, seconds = (8, 5.0) if quick else (25, 30.0)
    callers = 10 * capacity
    checks = Checks()
    with EngineProcess("--model", "tiny", "--max-batch", "8", "--queue-capacity", str(capacity),
                       "--max-new-tokens", str(MAX_NEW)) as engine:
        assert engine.proc is not None
        pid = engine.proc.pid
        stub = engine.stub()
        warm = [collect(stub.Decode(pb.DecodeRequest(prompt_text=f"warm {i}", max_new_tokens=MAX_NEW, ignore_eos=True),
                                    timeout=30)) for i in range(8)]  # before measuring memory
        checks.expect(all(a.ok for a in warm), f"warm-up requests failed: {[a.short() for a in warm if not a.ok][:2]}")
        rss_before = rss_kib(pid)
        note(NAME, f"{callers} callers for {seconds:g} s against --queue-capacity {capacity}")
        started = time.monotonic()
        tally = asyncio.run(storm(engine.address, pid, callers, seconds))
        elapsed = time.monotonic() - started
        load = engine.wait_load(lambda x: (x.running_sequences, x.waiting_requests, x.kv_cache_used_tokens) == (0, 0, 0))
        rss_after = rss_kib(pid)
        checks.expect(engine.proc.poll() is None, f"engine exited with {engine.proc.returncode}")
        checks.expect((load.running_sequences, load.waiting_requests, load.kv_cache_used_tokens) == (0, 0, 0),
                      f"load not back to zero: {load}")
    checks.expect(tally.completed > 0 and tally.rejected > 0,
                  f"not an overload: {tally.completed} completed, {tally.rejected} rejected")
    checks.expect(not tally.health_bad, f"health not SERVING in {len(tally.health_bad)} of {tally.health_polls} "
                                        f"polls: {tally.health_bad[:3]}")
    checks.expect(rss_after - rss_before <= RSS_GROWTH_BOUND_KIB,
                  f"RSS grew by {(rss_after - rss_before) // 1024} MiB (bound {RSS_GROWTH_BOUND_KIB // 1024} MiB)")
    total = tally.completed + tally.rejected + len(tally.lost)
    return checks.row(
        NAME,
        done=f"{callers} concurrent callers (10x --queue-capacity {capacity}, --max-batch 8) for {seconds:g} s, "
             f"each resending at once; health polled every 0.1 s",
        expected="every call OK with all its tokens, or RESOURCE_EXHAUSTED/QUEUE_FULL + RetryInfo before any token; "
                 f"health SERVING; RSS growth <= {RSS_GROWTH_BOUND_KIB // 1024} MiB; load back to 0",
        lost=len(tally.lost),
        figures={"peak callers": callers, "calls": total, "calls/s": round(total / elapsed),
                 "completed/s": round(tally.completed / elapsed), "completed": tally.completed,
                 "rejected QUEUE_FULL": tally.rejected, "health polls SERVING": f"{tally.health_polls - len(tally.health_bad)}/{tally.health_polls}",
                 "RSS MiB before/peak/after": f"{rss_before // 1024}/{tally.peak_rss_kib // 1024}/{rss_after // 1024}"},
    )
