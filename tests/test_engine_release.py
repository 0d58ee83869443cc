"""`Engine.release`, in-process: a caller that leaves (the servicer releases its handle before the
stream ended) has its sequence cancelled, and its row and KV are free within a step or two while
its generation is still far from its end; a finished request's release cancels nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from engine_service.config import EngineConfig
from engine_service.requests import Request, SamplingParams
from engine_service.runtime.build import build_engine
from engine_service.runtime.engine import Engine
from engine_service.scheduling.scheduler import LoadSnapshot

LONG = 4000  # tokens: about 6 s of decoding for the tiny model, far longer than any wait below
FREED_WITHIN_S = 0.5  # a step of the tiny model takes about a millisecond


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = await build_engine(EngineConfig(model="tiny", max_batch=1, max_context=4096, max_new_tokens_limit=LONG,
                                             queue_capacity=4))
    yield engine
    engine.stop()


def request(request_id: str, max_new: int = LONG) -> Request:
    return Request(request_id=request_id, prompt_ids=(256, 104, 105), max_new_tokens=max_new,
                   sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None)


async def wait_load(engine: Engine, predicate: Callable[[LoadSnapshot], bool], timeout: float) -> LoadSnapshot:
    deadline = time.monotonic() + timeout
    while not predicate(engine.load()) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return engine.load()


async def test_release_of_a_departed_caller_frees_its_row_within_a_step(engine: Engine) -> None:
    handle = engine.submit(request("departs"))
    assert (await handle.stream.next()).tokens
    load = await wait_load(engine, lambda x: x.running_sequences == 1, 1.0)
    assert load.running_sequences == 1 and load.kv_cache_used_tokens > 0
    engine.release(handle)  # what the servicer does when the caller cancels or goes away
    released = time.monotonic()
    load = await wait_load(engine, lambda x: x.running_sequences == 0, FREED_WITHIN_S)
    assert (load.running_sequences, load.kv_cache_used_tokens) == (0, 0), \
        f"still running {time.monotonic() - released:.2f} s after release, {len(handle.seq.generated)} tokens"
    assert handle.seq.cancelled and len(handle.seq.generated) < LONG // 2
    assert await engine.wait_idle(0.1)


async def test_release_of_a_queued_caller_drops_it_unprefilled(engine: Engine) -> None:
    blocker = engine.submit(request("blocker"))
    await blocker.stream.next()
    queued = engine.submit(request("queued"))
    await asyncio.sleep(0.05)
    assert engine.waiting() == 1
    engine.release(queued)
    load = await wait_load(engine, lambda x: x.waiting_requests == 0 and x.requests_finished == 1, FREED_WITHIN_S)
    assert engine.waiting() == 0 and load.requests_finished == 1 and load.running_sequences == 1
    assert queued.seq.timings.prefill_started is None and queued.seq.generated == []
    engine.release(blocker)
    load = await wait_load(engine, lambda x: x.running_sequences == 0, FREED_WITHIN_S)
    assert (load.running_sequences, load.kv_cache_used_tokens) == (0, 0)


async def test_release_after_the_end_cancels_nothing(engine: Engine) -> None:
    handle = engine.submit(request("short", max_new=5))
    tokens: list[int] = []
    while True:
        update = await handle.stream.next()
        tokens.extend(update.tokens)
        if update.finish is not None or update.error is not None:
            break
    assert len(tokens) == 5 and update.finish is not None
    assert not await engine.wait_idle(0)  # the handle is live until released
    engine.release(handle)
    assert not handle.seq.cancelled
    assert await engine.wait_idle(0.1)
