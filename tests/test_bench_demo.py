"""The README's main command: the packaged demo sweep on the real default model (SmolLM2), end to
end: a real chat answer first, then the sweep. The test runs the packaged file's own engine command,
preview, workload and policy, read from it, with its engine grid cut to one configuration (the
last) and its contexts to the smallest and the largest (which the engine refuses): the rest runs
the same code for another minute and a half, which `make test`'s 10-minute budget cannot spare.
tests/test_bench_config.py checks the packaged file itself."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.bench_helpers import events, point_counts, read_results, run_cli, write_config

DEMO = Path(__file__).resolve().parent.parent / "bench_client" / "demo.toml"


def test_demo_sweep_end_to_end(tmp_path: Path) -> None:
    raw = tomllib.loads(DEMO.read_text())
    grid = raw["engine"]["grid"]
    assert list(grid) == ["max_batch"] and len(grid["max_batch"]) > 1, grid
    grid["max_batch"] = grid["max_batch"][-1:]
    contexts = raw["workload"]["context_tokens"]
    raw["workload"]["context_tokens"] = [min(contexts), max(contexts)]
    out = tmp_path / "demo"
    done = run_cli("sweep", str(write_config(tmp_path / "demo.toml", raw)), "--out", str(out), timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    # the answer, streamed before the first point, from the real model
    assert "Question to smollm2 (bfloat16): What is the capital of France?\nAnswer: " in done.stdout
    answer = done.stdout.split("Answer: ", 1)[1].split("\n", 1)[0]
    assert "Paris" in answer, done.stdout[:2000]
    assert done.stdout.index("Paris") < done.stdout.index("sweep results")
    assert [e["finish_reason"] for e in events(done.stderr) if e["event"] == "preview_answered"] == ["EOS"]
    records = read_results(out)
    assert set(point_counts(records).values()) == {1}
    assert {r["server_info"]["model"] for r in records} == {"smollm2"}
    skipped = [r for r in records if r["status"] == "skipped"]
    assert skipped and all(r["reason"] == "CONTEXT_LENGTH_EXCEEDED" for r in skipped)
    assert any(not r["skipped_without_sending"] for r in skipped), "the engine itself refuses one point"
    assert all(r["status"] == "ok" for r in records if r["status"] != "skipped")
    # every point's prompts are its own: no point is served from the prefix cache by another's
    measured = [r for r in records if r["metrics"] is not None]
    assert measured and all(r["prefix_tokens"] == 0 and r["metrics"]["total_cached_prompt_tokens"] == 0
                            for r in measured), [(r["concurrency"], r["metrics"]["mean_cached_prompt_tokens"])
                                                 for r in measured]
    assert "CONTEXT_LENGTH_EXCEEDED" in done.stdout
    assert any(e["event"] == "point_skipped" for e in events(done.stderr))
    assert [e["how"] for e in events(done.stderr) if e["event"] == "engine_exited"] == ["drained"]
    assert (out / "throughput_vs_concurrency.png").exists() and (out / "latency_vs_context.png").exists()
