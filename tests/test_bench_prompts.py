"""Prompts with shared prefixes (workload.prefix_tokens, prefix_groups): the prefix is one per
group, the rest unique per request, the length exact and everything reproducible; the point runner
gives request i (warmup ones too) the prefix of group i % groups, and the engine's cached prompt
tokens travel from the last Decode message into the request outcome, the metrics and the records."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from bench_client import records
from bench_client.config import PolicyConfig, WorkloadConfig, parse_config
from bench_client.point import PointOutcome, PointRunner, PointSpec, RequestResult
from bench_client.progress import SweepProgress
from bench_client.prompts import make_prompt
from bench_client.results import PointKey, ResultsDir
from bench_client.rpc import _chunk
from bench_client.server_api import Chunk, DecodeSpec, ServerInfo
from bench_client.sweep import SweepRunner, grid_points
from engine.v1 import engine_pb2

VOCAB, BOS, EOS = 258, 256, 257
INFO = ServerInfo(model="fake", max_context_tokens=256, max_new_tokens_limit=64, max_batch_size=8,
                  queue_capacity=64, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=BOS, device="cpu",
                  dtype="float32", tokenizer="byte", engine_version="0")


def prompt(index: int, *, length: int = 80, prefix: int = 64, group: int = 0, seed: int = 0) -> tuple[int, ...]:
    return make_prompt(seed=seed, length=length, index=index, vocab_size=VOCAB, avoid=(BOS, EOS),
                       prefix_tokens=prefix, prefix_group=group)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_requests_of_a_group_share_exactly_the_prefix() -> None:
    prompts = [prompt(i, group=0) for i in range(8)]
    assert all(len(p) == 80 for p in prompts)
    assert len({p[:64] for p in prompts}) == 1  # one prefix for the group
    assert len({p[64:] for p in prompts}) == 8  # and unique parts of 16 tokens each
    assert all(len(p[64:]) == 16 for p in prompts)
    # a unique part depends on (seed, length, index) only: the start of that request's prompt without a prefix
    assert all(p[64:] == prompt(i, prefix=0)[:16] for i, p in enumerate(prompts))
    assert all(BOS not in p and EOS not in p and all(0 <= t < VOCAB for t in p) for p in prompts)


def test_groups_have_different_prefixes_and_the_same_prefix_at_every_length() -> None:
    prefixes = [prompt(0, group=g)[:64] for g in range(4)]
    assert len(set(prefixes)) == 4
    assert all(common_prefix(prefixes[0], other) < 8 for other in prefixes[1:])  # unrelated draws
    # a group's prefix depends on (seed, group) only: the same at another context length and index,
    # and a shorter prefix of the group is the start of a longer one
    assert prompt(5, length=200, group=2)[:64] == prefixes[2]
    assert prompt(3, length=200, prefix=100, group=2)[:64] == prefixes[2]
    assert prompt(0, group=0, seed=1)[:64] != prefixes[0]  # another seed, another prefix


def test_prompts_are_reproducible_and_unchanged_without_a_prefix() -> None:
    assert prompt(3, group=1) == prompt(3, group=1)
    assert prompt(3, group=1) != prompt(4, group=1)
    # prefix_tokens 0 sends the prompts the client sent before prefixes existed (resumed sweeps
    # and earlier results stay comparable): values recorded from that version
    assert make_prompt(seed=0, length=8, index=3, vocab_size=VOCAB, avoid=(BOS, EOS)) == (
        52, 1, 137, 96, 34, 209, 129, 243)
    assert make_prompt(seed=7, length=5, index=-1, vocab_size=VOCAB, avoid=(BOS, EOS)) == (11, 173, 165, 10, 120)
    assert prompt(3, length=8, prefix=0, group=0) == (52, 1, 137, 96, 34, 209, 129, 243)


def test_a_prefix_as_long_as_the_prompt_leaves_no_unique_part() -> None:
    assert prompt(0, prefix=80) == prompt(1, prefix=80) == prompt(0, length=120, prefix=120)[:80]
    assert len(prompt(0, prefix=80)) == 80


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prefix_tokens": 81}, "prefix_tokens must be in 0..length 80, got 81"),
    ({"prefix_tokens": -1}, "prefix_tokens must be in 0..length 80, got -1"),
    ({"prefix_tokens": 8, "prefix_group": -1}, "prefix_group must be >= 0, got -1"),
])
def test_impossible_prefixes_are_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        make_prompt(seed=0, length=80, index=0, vocab_size=VOCAB, **kwargs)


# ---- the point runner, against a fake engine with a token-granular prefix cache -----------------


class Answer:
    """What EngineClient.decode returns: the chunks, and the replica that answered (one here)."""

    def __init__(self, chunks: AsyncIterator[Chunk]) -> None:
        self.replica = "fake:0"
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks


class PrefixCachingEngine:
    """Answers each Decode with one token; reports as cached the longest start the prompt shares with
    any earlier prompt (a prefix cache of unbounded size)."""

    target = "fake:0"

    def __init__(self) -> None:
        self.prompts: dict[str, tuple[int, ...]] = {}

    def decode(self, spec: DecodeSpec, *, timeout: float,
               attributes: Mapping[str, Any] | None = None) -> Answer:
        return Answer(self._answer(spec))

    async def _answer(self, spec: DecodeSpec) -> AsyncIterator[Chunk]:
        ids = spec.prompt_token_ids
        cached = max((common_prefix(ids, p) for p in self.prompts.values()), default=0)
        self.prompts[spec.request_id] = ids
        yield Chunk(received_at=time.perf_counter(), num_tokens=1, text="", finish_reason="LENGTH",
                    prompt_tokens=len(ids), completion_tokens=1, timing=None, cached_prompt_tokens=cached)


class Serving:
    async def wait_until_serving(self, timeout: float) -> bool:
        return True


class Quiet:
    def request_started(self, spec: PointSpec) -> None:
        return None

    def request_finished(self, spec: PointSpec, outcome: RequestResult) -> None:
        return None


async def run_point(warmup: int, requests: int = 6) -> tuple[PrefixCachingEngine, PointSpec, Any]:
    workload = WorkloadConfig(prompt_format="token_ids", context_tokens=(80,), max_new_tokens=(1,), concurrency=(1,),
                              requests_per_point=requests, warmup_requests=warmup, prefix_tokens=64, prefix_groups=2)
    spec = PointSpec(80, 1, 1, math.inf, prefix_tokens=64, prefix_groups=2)
    engine = PrefixCachingEngine()
    runner = PointRunner(engine, INFO, workload, PolicyConfig(), Serving(), Quiet(), "run")  # type: ignore[arg-type]
    return engine, spec, await runner.run(spec)


async def test_point_requests_rotate_over_the_groups_and_record_cached_tokens() -> None:
    engine, spec, outcome = await run_point(warmup=2)
    sent = {rid.split("-")[-2]: ids for rid, ids in engine.prompts.items()}  # "w0", "m3", ...
    assert sorted(sent) == ["m0", "m1", "m2", "m3", "m4", "m5", "w0", "w1"]
    group_prefix = [prompt(0, group=g)[:64] for g in range(2)]
    for name, ids in sent.items():
        assert len(ids) == 80 and ids[:64] == group_prefix[int(name[1:]) % 2], name  # warmups too
    assert len({ids[64:] for ids in sent.values()}) == 8  # no unique part repeats, warmups included
    # the warmups put both prefixes in the cache: every measured request finds at least its prefix
    cached = [r.timeline.cached_prompt_tokens for r in outcome.requests]
    assert all(64 <= c < 80 for c in cached), cached

    record = records.point_record(outcome, engine=None, target="fake:0", server_info=INFO, run_id="run",
                                  started_at=0.0, warmup=2, max_error_rate=0.0)
    assert (record["prefix_tokens"], record["prefix_groups"]) == (64, 2)
    assert record["metrics"]["total_cached_prompt_tokens"] == sum(cached)
    assert record["metrics"]["mean_cached_prompt_tokens"] == pytest.approx(sum(cached) / 6)
    detail = records.request_record(spec, outcome.requests[3], engine=None, run_id="run")
    assert detail["cached_prompt_tokens"] == cached[3] and detail["prompt_tokens"] == 80
    assert (detail["prefix_tokens"], detail["prefix_groups"], detail["prefix_group"]) == (64, 2, 1)


async def test_without_warmup_the_first_request_of_each_group_misses() -> None:
    _, _, outcome = await run_point(warmup=0)
    cached = [r.timeline.cached_prompt_tokens for r in outcome.requests]
    assert cached[0] == 0  # nothing was cached before it
    assert cached[1] < 64  # group 1's prefix is not group 0's
    assert all(c >= 64 for c in cached[2:]), cached


def test_the_last_message_carries_the_cached_prompt_tokens() -> None:
    last = engine_pb2.DecodeResponse(
        token_ids=[5], finish_reason=engine_pb2.FINISH_REASON_LENGTH,
        usage=engine_pb2.Usage(prompt_tokens=80, completion_tokens=4, cached_prompt_tokens=64))
    chunk = _chunk(last, 1.0)
    assert (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_prompt_tokens) == (80, 4, 64)
    middle = _chunk(engine_pb2.DecodeResponse(token_ids=[5]), 1.0)
    assert middle.cached_prompt_tokens is None and middle.finish_reason is None


def test_the_sweep_resumes_points_by_their_prefix_too(tmp_path: Path) -> None:
    def config(**prefix: int) -> Any:
        return parse_config({"target": "127.0.0.1:1", "workload": {
            "context_tokens": [80, 96], "max_new_tokens": [4], "concurrency": [1], **prefix}})

    specs = grid_points(config(prefix_tokens=64, prefix_groups=3))
    assert {(s.prefix_tokens, s.prefix_groups) for s in specs} == {(64, 3)} and len(specs) == 2
    assert specs[0].tag() == "c80-n4-x1-rinf-p64g3"
    assert grid_points(config())[0].tag() == "c80-n4-x1-rinf"  # as before prefixes existed (request ids, arrivals)
    # the key the runner looks up is the key of the record it writes for that point
    results = ResultsDir.open(tmp_path / "out", resume=False)
    runner = SweepRunner(config(prefix_tokens=64, prefix_groups=3), results, SweepProgress(enabled=False))
    outcome = PointOutcome(specs[0], (), duration_s=0.0, retries=0)
    record = records.point_record(outcome, engine=None, target="t", server_info=INFO, run_id="r", started_at=0.0,
                                  warmup=0, max_error_rate=0.0)
    results.append_point(record)
    assert runner._key(runner.config.servers[0], None, specs[0]) == PointKey.of_record(record) == PointKey("null", 80, 4, 1, math.inf, 64, 3)
    assert runner._key(runner.config.servers[0], None, specs[0]) in results.done
    assert runner._key(runner.config.servers[0], None, grid_points(config(prefix_tokens=32))[0]) not in results.done
    assert runner._key(runner.config.servers[0], None, grid_points(config())[0]) not in results.done


async def test_every_point_sends_prompts_of_its_own_and_a_rerun_sends_the_same() -> None:
    """The demo's `cached` column once read 432 of 448 at concurrency 8: the second point at a
    context sent the first point's prompts. Now only the shared prefix is shared between points."""
    workload = WorkloadConfig(prompt_format="token_ids", context_tokens=(40,), max_new_tokens=(1,), concurrency=(1, 2),
                              requests_per_point=3, warmup_requests=1)
    engine = PrefixCachingEngine()
    runner = PointRunner(engine, INFO, workload, PolicyConfig(), Serving(), Quiet(), "run")  # type: ignore[arg-type]
    first = await runner.run(PointSpec(40, 1, 1, math.inf))
    second = await runner.run(PointSpec(40, 1, 2, math.inf))
    # no prompt of the second point shares more than chance with any earlier one (1 token at most)
    assert [r.timeline.cached_prompt_tokens for r in second.requests] == [0, 0, 0] or \
        max(r.timeline.cached_prompt_tokens for r in second.requests) <= 1
    assert all(r.timeline.cached_prompt_tokens <= 1 for r in first.requests)
    # a rerun of the same point (a resumed sweep) sends the very same prompts
    again = PrefixCachingEngine()
    rerun = PointRunner(again, INFO, workload, PolicyConfig(), Serving(), Quiet(), "run2")  # type: ignore[arg-type]
    await rerun.run(PointSpec(40, 1, 2, math.inf))
    by_name = {rid.split("-")[-2]: ids for rid, ids in again.prompts.items()}
    original = {rid.split("-")[-2]: ids for rid, ids in engine.prompts.items() if "-x2-" in rid}
    assert by_name == original and len(by_name) == 4
