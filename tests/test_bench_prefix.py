"""Shared prompt prefixes against a real engine with a prefix cache: the sweep sends prompts that
share their first `prefix_tokens`, the engine reports the prompt tokens its cache supplied
(Usage.cached_prompt_tokens), and the point's record and the per-request lines carry them."""

from __future__ import annotations

import json
from pathlib import Path

from bench_client.sweep import SweepEnd
from tests.bench_helpers import run_in_process, sweep_raw


async def test_requests_after_the_first_hit_the_engines_prefix_cache(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--prefix-cache-tokens", "4096")
    raw = sweep_raw(engine.address, context_tokens=[80], prefix_tokens=64, max_new_tokens=[4], concurrency=[1],
                    requests_per_point=4, warmup_requests=0)
    result, results = await run_in_process(raw, tmp_path / "out", detail=True)
    assert result.end is SweepEnd.COMPLETED
    [record] = results.records
    assert record["status"] == "ok" and record["requests"]["completed"] == 4
    assert (record["prefix_tokens"], record["prefix_groups"]) == (64, 1)
    details = sorted((json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()),
                     key=lambda d: d["index"])
    assert [d["index"] for d in details] == [0, 1, 2, 3] and all(d["prompt_tokens"] == 80 for d in details)
    cached = [d["cached_prompt_tokens"] for d in details]
    # a fresh engine and one request at a time: the first finds nothing cached, each later one its prefix
    assert cached[0] == 0, cached
    assert all(0 < c <= 80 for c in cached[1:]), cached
    metrics = record["metrics"]
    assert metrics["total_cached_prompt_tokens"] == sum(cached) > 0
    assert metrics["mean_cached_prompt_tokens"] == sum(cached) / 4
