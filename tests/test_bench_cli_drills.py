"""Drills of the sweep CLI as users run it: the skip in table and log, kill -9 then --resume, an
engine crash mid-sweep (unmanaged: the sweep stops resumable; managed: restarted), SIGTERM drain."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tests.bench_helpers import (
    ROOT,
    cli,
    events,
    managed_engine,
    point_counts,
    read_results,
    run_cli,
    sweep_raw,
    write_config,
)


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"sweep exited early with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {count} lines within {timeout}s")


def test_skip_is_shown_in_table_and_log(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--max-context", "256")
    config = write_config(tmp_path / "sweep.toml", sweep_raw(engine.address, context_tokens=[16, 300],
                                                             concurrency=[1, 2], requests_per_point=2))
    done = run_cli("sweep", str(config), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    skipped = [e for e in events(done.stderr) if e["event"] == "point_skipped"]
    assert [(e["context_tokens"], e["concurrency"], e["without_sending"]) for e in skipped] == [
        (300, 1, False), (300, 2, True)]
    assert all(e["level"] == "warning" and e["reason"] == "CONTEXT_LENGTH_EXCEEDED" for e in skipped)
    assert skipped[0]["reason_metadata"]["maxContextTokens"] == "256"
    assert "CONTEXT_LENGTH_EXCEEDED" in done.stdout and "skipped" in done.stdout
    statuses = {(r["context_tokens"], r["concurrency"]): r["status"] for r in read_results(tmp_path / "out")}
    assert statuses == {(16, 1): "ok", (16, 2): "ok", (300, 1): "skipped", (300, 2): "skipped"}
    assert (tmp_path / "out" / "throughput_vs_concurrency.png").exists()


def test_kill_9_then_resume_gives_every_point_once(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny")
    raw = sweep_raw(engine.address, context_tokens=[8, 16, 24, 32, 40], concurrency=[1, 2], requests_per_point=3,
                    max_new_tokens=[16])
    config = write_config(tmp_path / "sweep.toml", raw)
    out = tmp_path / "out"
    proc = subprocess.Popen(cli("sweep", str(config), "--out", str(out)), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lines(out / "results.jsonl", 3, proc)
    finally:
        proc.kill()  # SIGKILL: no handler runs
        proc.wait(10)
    recorded_before = read_results(out)
    assert 3 <= len(recorded_before) < 10
    with (out / "results.jsonl").open("a") as f:
        f.write('{"schema": "bench_client.point/1", "context_tokens": 4')  # as if killed mid-write
    refused = run_cli("sweep", str(config), "--out", str(out))
    assert refused.returncode == 2 and "--resume" in refused.stderr
    resumed = run_cli("sweep", str(config), "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "torn_line_removed" in [e["event"] for e in events(resumed.stderr)]
    records = read_results(out)
    assert records[: len(recorded_before)] == recorded_before  # nothing recorded was touched
    counts = point_counts(records)
    assert len(counts) == 10 and set(counts.values()) == {1}
    assert [e["already_recorded"] for e in events(resumed.stderr) if e["event"] == "sweep_started"] == [
        len(recorded_before)]


def test_engine_crash_stops_the_sweep_resumably(start_engine, tmp_path: Path) -> None:
    engine = start_engine("--model", "tiny", "--fault", "crash:step=40")
    raw = sweep_raw(engine.address, context_tokens=[8, 16, 24], concurrency=[1], requests_per_point=2,
                    max_new_tokens=[8], policy={"health_wait_s": 1.5})
    config = write_config(tmp_path / "sweep.toml", raw)
    out = tmp_path / "out"
    stopped = run_cli("sweep", str(config), "--out", str(out))
    assert stopped.returncode == 1, stopped.stderr
    assert "sweep stopped" in stopped.stderr and "was not SERVING within policy.health_wait_s=1.5" in stopped.stderr
    assert "sweep_stopped" in [e["event"] for e in events(stopped.stderr)]
    engine.wait(10)  # it crashed (exit code non-zero)
    assert engine.proc is not None and engine.proc.returncode != 0
    before = read_results(out)
    assert len(before) < 3
    replacement = start_engine("--model", "tiny")
    raw["target"] = replacement.address
    write_config(config, raw)
    resumed = run_cli("sweep", str(config), "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    counts = point_counts(read_results(out))
    assert len(counts) == 3 and set(counts.values()) == {1}


def test_managed_engine_is_restarted_after_a_crash(tmp_path: Path) -> None:
    raw = sweep_raw(engine=managed_engine("--fault", "crash:step=100", max_restarts=3), context_tokens=[8],
                    concurrency=[1, 2], requests_per_point=6, max_new_tokens=[16], warmup_requests=1,
                    policy={"health_wait_s": 60.0, "max_error_rate": 0.5})
    config = write_config(tmp_path / "sweep.toml", raw)
    done = run_cli("sweep", str(config), "--out", str(tmp_path / "out"), timeout=240)
    assert done.returncode == 0, done.stderr
    records = read_results(tmp_path / "out")
    assert len(records) == 2 and set(point_counts(records).values()) == {1}
    exits = [e for e in events(done.stderr) if e["event"] == "engine_exited"]
    assert exits[0]["how"] == "crashed" and exits[0]["exit_code"] != 0
    assert exits[-1]["how"] == "drained"
    engine_lines = (tmp_path / "out" / "engines.jsonl").read_text().splitlines()
    assert len(engine_lines) == len(exits) >= 2
    # the stream cut by the crash is a failed request (UNAVAILABLE), never a latency sample
    failed = sum(r["requests"]["failed_by_code"].get("UNAVAILABLE", 0) for r in records)
    assert failed >= 1


def test_sigterm_drains_engine_and_resume_completes(tmp_path: Path) -> None:
    raw = sweep_raw(engine=managed_engine(), context_tokens=[8, 16, 24, 32], concurrency=[1],
                    requests_per_point=4, max_new_tokens=[32])
    config = write_config(tmp_path / "sweep.toml", raw)
    out = tmp_path / "out"
    proc = subprocess.Popen(cli("sweep", str(config), "--out", str(out)), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for_lines(out / "results.jsonl", 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    names = [e["event"] for e in events(stderr)]
    assert "sweep_stop_requested" in names and "sweep_interrupted" in names
    exits = [e for e in events(stderr) if e["event"] == "engine_exited"]
    assert [(e["how"], e["exit_code"]) for e in exits] == [("drained", 0)]
    recorded = read_results(out)
    assert 1 <= len(recorded) < 4
    resumed = run_cli("sweep", str(config), "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    counts = point_counts(read_results(out))
    assert len(counts) == 4 and set(counts.values()) == {1}
