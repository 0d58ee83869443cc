"""The README's main command: the packaged demo sweep on the real default model (SmolLM2), end to
end: a real chat answer first, then the sweep of ShareGPT's prompts. The test runs the packaged
file's own engine command, preview, workload, SLOs and policy, read from it, with its engine grid
cut to one configuration (the first, as `make demo` starts: max_batch 4, whose engine traces one
decode regime at start-up where max_batch 16's traces three) and 4 requests a point: the rest runs
the same code for another minute, which `make test`'s 10-minute budget cannot spare (each regime's
trace is held to the eager step by tests/test_traced_decode.py). tests/test_bench_config.py checks
the packaged file itself."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from engine_service.machine.cpu import detect
from engine_service.machine.precision import choose_dtype
from tests.bench_helpers import events, point_counts, read_results, run_cli, write_config
from tests.llama_server import smollm2_gguf

DEMO = Path(__file__).resolve().parent.parent / "bench_client" / "demo.toml"


def test_demo_sweep_end_to_end(tmp_path: Path) -> None:
    raw = tomllib.loads(DEMO.read_text())
    grid = raw["engine"]["grid"]
    assert list(grid) == ["max_batch"] and len(grid["max_batch"]) > 1, grid
    grid["max_batch"] = grid["max_batch"][:1]  # 4: the concurrency-8 point's 4 requests still in one batch
    raw["workload"]["requests_per_point"] = 4  # of the file's 8: the same paths, half the decoding
    # the traced step: AOTInductor's first compile is a minute or more (tests/test_compiled_decode.py, in CI)
    raw["engine"]["command"] = [*raw["engine"]["command"], "--compile-decode", "off"]
    out = tmp_path / "demo"
    done = run_cli("sweep", str(write_config(tmp_path / "demo.toml", raw)), "--out", str(out), timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    # the answer, streamed before the first point, from the real model
    dtype = choose_dtype("auto", "cpu", detect())[0]  # the demo's engine chooses as on any machine: float32 on AVX2
    assert f"Question to smollm2 ({dtype}): What is the capital of France?\nAnswer: " in done.stdout
    answer = done.stdout.split("Answer: ", 1)[1].split("\n", 1)[0]
    assert "Paris" in answer, done.stdout[:2000]
    assert done.stdout.index("Paris") < done.stdout.index("sweep results")
    assert [e["finish_reason"] for e in events(done.stderr) if e["event"] == "preview_answered"] == ["EOS"]
    records = read_results(out)
    assert set(point_counts(records).values()) == {1}
    assert {r["server_info"]["model"] for r in records} == {"smollm2"}
    assert all(r["status"] == "ok" for r in records), [(r["status"], r["message"]) for r in records]
    assert {(r["dataset"], r["context_tokens"], r["tokenizer"]) for r in records} == {
        ("sharegpt", 0, f"smollm2 (GGUF {smollm2_gguf()})")}
    requests = raw["workload"]["requests_per_point"]
    for r in records:
        m = r["metrics"]
        # the engine's own counts: 32 new tokens each, the conversations' own prompt lengths
        assert m["completed"] == requests and m["total_output_tokens"] == requests * 32, m
        assert m["output_token_source"] == {"usage": requests}, m
        assert m["total_input_tokens"] % requests or m["total_input_tokens"] // requests > 4, m
        assert m["good_requests"] is not None and 0.0 <= m["slo_attainment"] <= 1.0, m
        assert m["request_goodput"] == pytest.approx(m["good_requests"] / m["duration_s"])
    # every point's prompts are its own: no point is served from the prefix cache by another's
    assert all(r["prefix_tokens"] == 0 and r["metrics"]["total_cached_prompt_tokens"] == 0 for r in records), [
        (r["concurrency"], r["metrics"]["mean_cached_prompt_tokens"]) for r in records]
    assert "sharegpt" in done.stdout and "good/s" in done.stdout
    read = [e for e in events(done.stderr) if e["event"] == "sharegpt_read"]
    assert read and read[0]["conversations"] == 17671 and read[0]["torn"], read
    assert [e["how"] for e in events(done.stderr) if e["event"] == "engine_exited"] == ["drained"]
    assert (out / "throughput_vs_concurrency.png").exists()
