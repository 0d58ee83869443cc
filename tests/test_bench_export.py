"""`export`: a results directory as vLLM's `bench serve --save-result` JSON, or CSV; unreadable runs exit 2."""

from __future__ import annotations

import copy
import csv
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench_client.__main__ import main
from bench_client.export import csv_field_names, export_run
from bench_client.results import REQUEST_SCHEMA, REQUESTS, RESULTS, SCHEMA, append_durably

TTFT_MS = [10.0, 20.0, 30.0, 40.0, 50.0]
VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
             "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms",
             "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms")


def summary(values_ms: list[float], percentiles: tuple[float, ...] = (50, 90, 95, 99)) -> dict[str, Any]:
    """A latency object of the new schema, computed with numpy (the reference vLLM uses)."""
    return {"mean": float(np.mean(values_ms)), "median": float(np.median(values_ms)),
            "p90": float(np.percentile(values_ms, 90)), "p99": float(np.percentile(values_ms, 99)),
            "std": float(np.std(values_ms)),
            "percentiles": {f"{p:g}": float(np.percentile(values_ms, p)) for p in percentiles}}


def old_summary(values_ms: list[float]) -> dict[str, Any]:
    """A latency object as records before std and percentiles wrote it."""
    full = summary(values_ms)
    return {key: full[key] for key in ("mean", "median", "p90", "p99")}


def metrics(scale: float = 1.0, *, goodput: float | None = None, old: bool = False) -> dict[str, Any]:
    """Metrics of 5 completed requests whose TTFTs are TTFT_MS * scale."""
    latency = old_summary if old else summary
    out: dict[str, Any] = {
        "completed": 5, "duration_s": 2.0, "total_input_tokens": 320, "total_output_tokens": 160,
        "total_cached_prompt_tokens": 0, "mean_cached_prompt_tokens": 0.0, "request_throughput": 2.5,
        "output_throughput": 80.0 / scale, "total_token_throughput": 240.0,
        "ttft_ms": latency([v * scale for v in TTFT_MS]), "tpot_ms": latency([5.0 * scale, 6.0 * scale]),
        "itl_ms": latency([4.0 * scale, 6.0 * scale]), "e2el_ms": latency([100.0 * scale, 200.0 * scale]),
        "engine_queue_ms": latency([1.0]), "engine_ttft_ms": latency([8.0]),
    }
    if not old:
        out.update(request_goodput=goodput, good_requests=None if goodput is None else 4,
                   slo_attainment=None if goodput is None else 0.8)
    return out


def point(*, context: int = 64, concurrency: int = 4, server: str = "", status: str = "ok",
          scale: float = 1.0, goodput: float | None = None, run_id: str = "run-1", **top: Any) -> dict[str, Any]:
    """A point record of the new schema (results.py plus the workload keys)."""
    record: dict[str, Any] = {
        "schema": SCHEMA, "server": server, "api": "openai", "context_tokens": context, "max_new_tokens": 32,
        "concurrency": concurrency, "request_rate": "inf", "prefix_tokens": 0, "prefix_groups": 1,
        "dataset": "sharegpt", "endpoint": "chat", "prompt_format": "text", "tokenizer": "smollm2",
        "burstiness": 0.5, "duration_s": 60.0, "slo": {"ttft_ms": 45.0, "e2el_ms": 500.0}, "search": None,
        "engine": {"max_batch": 8}, "target": "127.0.0.1:8000",
        "server_info": {"model": "SmolLM2-135M", "tokenizer": "byte"},
        "status": status, "reason": None, "reason_metadata": {}, "message": "", "skipped_without_sending": False,
        "requests": {"sent": 5, "completed": 5, "failed": 0, "failed_by_code": {}, "failed_by_reason": {},
                     "retries": 1, "warmup": 2, "by_replica": {}, "truncated": 0},
        "metrics": metrics(scale, goodput=goodput),
        "started_at": 1700000000.0, "finished_at": 1700000002.0, "run_id": run_id,
    }
    if status == "skipped":
        record.update(reason="CONTEXT_LENGTH_EXCEEDED", reason_metadata={"promptTokens": str(context)},
                      message="too long", skip_code="HTTP_400", metrics=None,
                      requests={**record["requests"], "completed": 0, "retries": 0})
    if status == "failed":
        record.update(reason="ERROR_RATE_EXCEEDED", message="3 of 5 requests failed",
                      requests={**record["requests"], "completed": 2, "failed": 3, "failed_by_code": {"ABORTED": 3}})
    record.update(top)
    return record


def old_point(**top: Any) -> dict[str, Any]:
    """A record written before the workload keys, std and percentiles existed."""
    record = point(**top)
    for key in ("dataset", "endpoint", "prompt_format", "tokenizer", "burstiness", "duration_s", "slo", "search"):
        del record[key]
    record["api"] = "engine.v1"
    record["metrics"] = metrics(old=True)
    return record


def write_run(path: Path, records: list[dict[str, Any]], requests: list[dict[str, Any]] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for record in records:
        append_durably(path / RESULTS, record)
    for request in requests or []:
        append_durably(path / REQUESTS, {"schema": REQUEST_SCHEMA, **request})
    return path


def request(index: int, *, run_id: str = "run-1", warmup: bool = False, status: str = "ok",
            messages: list[list[float]] | None = None, context: int = 64) -> dict[str, Any]:
    """A requests.jsonl line of point() (records.request_record's keys)."""
    line: dict[str, Any] = {
        "run_id": run_id, "server": "", "engine": {"max_batch": 8}, "context_tokens": context, "max_new_tokens": 32,
        "concurrency": 4, "request_rate": "inf", "prefix_tokens": 0, "prefix_groups": 1, "prefix_group": None,
        "index": index, "warmup": warmup, "attempts": 1, "sent_at": 1700000000.0 + index, "status": status,
        "code": None, "reason": None, "message": "", "peer": None,
    }
    if status == "failed":
        return {**line, "code": "HTTP_500", "reason": "INTERNAL", "message": "boom"}
    messages = messages or [[0.01, 1], [0.03, 1], [0.06, 1]]
    return {**line, "ttft_s": messages[0][0], "e2el_s": messages[-1][0], "output_tokens": 3, "prompt_tokens": 60 + index,
            "cached_prompt_tokens": 0, "messages": messages, "engine_queue_s": None, "engine_ttft_s": None,
            "usage_completion_tokens": 3, "server_timings": None}


def test_json_has_vllms_fields_with_the_records_values(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [point(goodput=2.0), point(context=4096, status="skipped")])
    exported = json.loads(export_run(run).to_json())
    ok, skipped = exported
    assert set(VLLM_KEYS) <= set(ok) and list(ok) == list(skipped)  # every entry has the same keys
    assert ok["p95_ttft_ms"] == 48.0 and ok["p50_ttft_ms"] == 30.0 and ok["median_ttft_ms"] == 30.0
    assert ok["p99_ttft_ms"] == pytest.approx(49.6) and ok["mean_ttft_ms"] == 30.0
    assert ok["std_ttft_ms"] == pytest.approx(statistics.pstdev(TTFT_MS))
    # a managed engine's address changes with its settings: the label is its API, as in the report
    assert (ok["endpoint_type"], ok["backend"], ok["label"]) == ("openai-chat", "openai-chat", "openai")
    assert (ok["model_id"], ok["tokenizer_id"], ok["date"]) == ("SmolLM2-135M", "smollm2", "20231114-221320")
    assert (ok["num_prompts"], ok["max_concurrency"], ok["request_rate"], ok["burstiness"]) == (5, 4, "inf", 0.5)
    assert (ok["duration"], ok["completed"], ok["failed"], ok["output_throughput"]) == (2.0, 5, 0, 80.0)
    assert (ok["request_goodput"], ok["good_requests"], ok["slo_attainment"]) == (2.0, 4, 0.8)
    assert (ok["slo_ttft_ms"], ok["slo_tpot_ms"], ok["slo_e2el_ms"]) == (45.0, None, 500.0)
    assert (ok["dataset"], ok["endpoint"], ok["duration_limit_s"], ok["engine"]) == ("sharegpt", "chat", 60.0,
                                                                                      {"max_batch": 8})
    assert ok["mean_engine_ttft_ms"] == 8.0 and ok["retries"] == 1 and ok["status"] == "ok"
    assert "ttfts" not in ok  # no requests.jsonl: no per-request lists, as vLLM without --save-detailed
    assert (skipped["status"], skipped["reason"], skipped["skip_code"]) == ("skipped", "CONTEXT_LENGTH_EXCEEDED",
                                                                            "HTTP_400")
    assert skipped["median_ttft_ms"] is None and skipped["duration"] is None and skipped["completed"] == 0


def test_older_records_read_as_the_defaults(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [old_point(), point()])  # a run resumed across the schema change
    old, new = export_run(run).entries
    assert (old["dataset"], old["endpoint"], old["prompt_format"], old["burstiness"]) == (
        "random", "completions", "token_ids", 1.0)
    assert (old["backend"], old["tokenizer_id"], old["duration_limit_s"], old["slo_ttft_ms"]) == (
        "engine.v1", "byte", None, None)
    assert old["p50_ttft_ms"] == 30.0 and old["p99_ttft_ms"] == pytest.approx(49.6)
    assert old["p95_ttft_ms"] is None and old["std_ttft_ms"] is None  # not known to records that old
    assert old["request_goodput"] is None and old["slo_attainment"] is None
    assert new["p95_ttft_ms"] == 48.0


def test_per_request_lists_from_requests_jsonl(tmp_path: Path) -> None:
    requests = [request(0, warmup=True), request(1), request(0, run_id="crashed-run"),
                request(2, status="failed"), request(0), request(3, context=4096, status="failed")]
    run = write_run(tmp_path / "run", [point(), point(context=4096, status="skipped")], requests)
    ok, skipped = export_run(run).entries
    assert ok["input_lens"] == [60, 61, 64] and ok["output_lens"] == [3, 3, 0]  # measured lines of run-1, by index
    assert ok["ttfts"] == [0.01, 0.01, 0.0] and ok["latencies"] == [0.06, 0.06, 0.0]
    assert ok["itls"][0] == pytest.approx([0.02, 0.03]) and ok["itls"][2] == []
    assert ok["errors"] == ["", "", "HTTP_500 INTERNAL: boom"]
    assert ok["start_times"] == [1700000000.0, 1700000001.0, 1700000002.0]
    assert skipped["input_lens"] == [4096] and skipped["errors"] == ["HTTP_500 INTERNAL: boom"]


def test_csv_has_a_fixed_header_and_one_row_per_point(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [point(goodput=2.0), point(context=4096, status="skipped"),
                                       point(concurrency=8, status="failed")])
    out = tmp_path / "points.csv"
    assert main(["export", str(run), "--format", "csv", "--out", str(out)]) == 0
    rows = list(csv.reader(io.StringIO(out.read_text())))
    assert rows[0] == csv_field_names(["50", "90", "95", "99"])
    assert rows[0][:5] == ["date", "endpoint_type", "backend", "label", "model_id"]
    assert "ttfts" not in rows[0] and "p95_ttft_ms" in rows[0]
    table = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["status"] for r in table] == ["ok", "skipped", "failed"]
    assert table[0]["p95_ttft_ms"] == "48.0" and table[0]["request_goodput"] == "2.0"
    assert table[1]["median_ttft_ms"] == "" and table[1]["reason"] == "CONTEXT_LENGTH_EXCEEDED"
    assert json.loads(table[2]["failed_by_code"]) == {"ABORTED": 3} and table[2]["failed"] == "3"
    assert json.loads(table[0]["engine"]) == {"max_batch": 8}


def test_json_to_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", [point()])
    assert main(["export", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)[0]["median_ttft_ms"] == 30.0


@pytest.mark.parametrize("case", ["missing", "file", "no_results", "corrupt", "bad_record", "bad_requests"])
def test_an_unreadable_run_is_exit_2_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     case: str) -> None:
    run = tmp_path / "run"
    expected = str(run)
    if case == "file":
        run.write_text("not a directory")
    if case == "no_results":
        run.mkdir()
        expected = f"{run / RESULTS} does not exist"
    if case == "corrupt":
        write_run(run, [point()])
        with (run / RESULTS).open("a") as f:
            f.write("{torn\n")
        write_run(run, [point(concurrency=8)])
        expected = f"{run / RESULTS} line 2 is not a JSON object"
    if case == "bad_record":
        broken = point()
        del broken["requests"]
        write_run(run, [broken])
        expected = f"{run / RESULTS} point 1: the record lacks or mangles a field (KeyError: 'requests')"
    if case == "bad_requests":
        write_run(run, [point()], [request(0)])
        with (run / REQUESTS).open("a") as f:
            f.write(json.dumps({"schema": "other/1"}) + "\n")
        expected = f"{run / REQUESTS} line 2 has schema 'other/1', expected {REQUEST_SCHEMA!r}"
    assert main(["export", str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and expected in captured.err


def test_a_torn_last_line_is_skipped_not_an_error(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [point()], [request(0)])
    for name in (RESULTS, REQUESTS):
        with (run / name).open("a") as f:
            f.write('{"schema": "bench_cl')
    before = (run / RESULTS).read_bytes()
    exported = export_run(run)
    assert len(exported.entries) == 1 and exported.entries[0]["ttfts"] == [0.01]
    assert (run / RESULTS).read_bytes() == before  # export reads only


def test_unwritable_out_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", [point()])
    assert main(["export", str(run), "--out", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert "--out" in capsys.readouterr().err


def test_export_as_a_subprocess(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [copy.deepcopy(point())])
    done = subprocess.run([sys.executable, "-m", "bench_client", "export", str(run), "--format", "csv"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    header, row = list(csv.reader(io.StringIO(done.stdout)))
    assert dict(zip(header, row, strict=True))["median_ttft_ms"] == "30.0"
    missing = subprocess.run([sys.executable, "-m", "bench_client", "export", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 2 and str(tmp_path / "nope") in missing.stderr
