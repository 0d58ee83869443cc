"""The report: the table shows skipped and failed points with their reasons; the plots are PNGs."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from rich.console import Console

from bench_client import records
from bench_client.__main__ import main
from bench_client.metrics import Arrival, RequestTimeline
from bench_client.point import PointOutcome, PointSpec, RequestResult
from bench_client.report import LATENCY_PLOT, THROUGHPUT_PLOT, print_table, write_plots
from bench_client.results import RESULTS
from bench_client.server_api import ServerInfo

INFO = ServerInfo(model="tiny", max_context_tokens=256, max_new_tokens_limit=4096, max_batch_size=8,
                  queue_capacity=64, vocab_size=258, eos_token_id=257, bos_token_id=256, device="cpu",
                  dtype="float32", tokenizer="byte", engine_version="0.1.0")


def ok_request(index: int, start: float) -> RequestResult:
    timeline = RequestTimeline(sent_at=start, arrivals=(Arrival(start + 0.01, 1), Arrival(start + 0.03, 3)),
                               prompt_tokens=32, engine_queue_s=0.001, engine_ttft_s=0.008)
    return RequestResult(index=index, warmup=False, attempts=1, timeline=timeline)


def failed_request(index: int) -> RequestResult:
    return RequestResult(index=index, warmup=False, attempts=1, timeline=None, status_code="ABORTED",
                          reason="SEQUENCE_ABORTED", message="sequence r aborted")


def sample_records() -> list[dict]:
    out = []
    for engine in ({"max_batch": 4}, {"max_batch": 16}):
        for context in (32, 64):
            for concurrency in (1, 4):
                spec = PointSpec(context, 4, concurrency, math.inf)
                outcome = PointOutcome(spec, tuple(ok_request(i, i * 0.1) for i in range(4)), duration_s=0.5,
                                       retries=0)
                out.append(records.point_record(outcome, engine=engine, target="t", server_info=INFO, run_id="r",
                                                started_at=0.0, warmup=1, max_error_rate=0.1))
        spec = PointSpec(64, 4, 8, math.inf)
        failing = PointOutcome(spec, (ok_request(0, 0.0), failed_request(1)), duration_s=0.5, retries=2)
        out.append(records.point_record(failing, engine=engine, target="t", server_info=INFO, run_id="r",
                                        started_at=0.0, warmup=1, max_error_rate=0.1))
        out.append(records.skipped_record(PointSpec(300, 4, 1, math.inf), engine=engine, target="t",
                                          server_info=INFO, run_id="r", started_at=0.0,
                                          reason="CONTEXT_LENGTH_EXCEEDED",
                                          reason_metadata={"promptTokens": "300", "maxContextTokens": "256"},
                                          message="too long", without_sending=False))
    return out


def test_failed_point_counts_by_code_and_keeps_latencies_of_successes() -> None:
    failed = [r for r in sample_records() if r["status"] == "failed"][0]
    assert failed["reason"] == records.ERROR_RATE_EXCEEDED
    assert failed["requests"]["failed_by_code"] == {"ABORTED": 1}
    assert failed["requests"]["completed"] == 1
    assert failed["metrics"]["completed"] == 1  # the failed request is not in the latencies
    assert failed["metrics"]["ttft_ms"]["mean"] == 10.0


def test_table_shows_skipped_and_failed_with_reasons() -> None:
    buffer = io.StringIO()
    print_table(sample_records(), Console(file=buffer, width=250))
    text = buffer.getvalue()
    assert "skipped" in text and "CONTEXT_LENGTH_EXCEEDED" in text and "promptTokens=300" in text
    assert "failed" in text and "ERROR_RATE_EXCEEDED" in text and "ABORTED:1" in text


def test_plots_are_written(tmp_path: Path) -> None:
    paths = write_plots(sample_records(), tmp_path)
    assert {p.name for p in paths} == {THROUGHPUT_PLOT, LATENCY_PLOT}
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_plots([r for r in sample_records() if r["status"] == "skipped"], tmp_path / "none") == []


def test_report_command(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in sample_records()))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CONTEXT_LENGTH_EXCEEDED" in out and (tmp_path / THROUGHPUT_PLOT).exists()
    assert main(["report", str(tmp_path / "missing")]) == 2


def cached_request(index: int, cached: int) -> RequestResult:
    timeline = RequestTimeline(sent_at=0.0, arrivals=(Arrival(0.01, 1), Arrival(0.03, 3)), prompt_tokens=96,
                               cached_prompt_tokens=cached)
    return RequestResult(index=index, warmup=False, attempts=1, timeline=timeline)


def table_rows(records_: list[dict]) -> list[list[str]]:
    buffer = io.StringIO()
    print_table(records_, Console(file=buffer, width=300))
    return [[cell.strip() for cell in line.replace("┃", "│").split("│")[1:-1]]
            for line in buffer.getvalue().splitlines() if line.startswith(("│", "┃"))]


def test_table_shows_the_prefix_and_the_mean_cached_prompt_tokens() -> None:
    spec = PointSpec(96, 4, 1, math.inf, prefix_tokens=64, prefix_groups=4)
    outcome = PointOutcome(spec, (cached_request(0, 0), cached_request(1, 64), cached_request(2, 80)),
                           duration_s=0.5, retries=0)
    record = records.point_record(outcome, engine=None, target="t", server_info=INFO, run_id="r", started_at=0.0,
                                  warmup=0, max_error_rate=0.1)
    assert (record["prefix_tokens"], record["prefix_groups"]) == (64, 4)
    assert record["metrics"]["total_cached_prompt_tokens"] == 144
    assert record["metrics"]["mean_cached_prompt_tokens"] == 48.0
    header, row = table_rows([record])
    assert row[header.index("prefix")] == "64 x4" and row[header.index("ctx")] == "96"
    assert row[header.index("cached")] == "48.0"


def test_records_older_than_the_prefix_keys_still_print_and_plot(tmp_path: Path) -> None:
    old = [json.loads(json.dumps(r)) for r in sample_records()]
    for r in old:
        for key in ("prefix_tokens", "prefix_groups"):
            del r[key]
        if r["metrics"] is not None:
            for key in ("total_cached_prompt_tokens", "mean_cached_prompt_tokens"):
                del r["metrics"][key]
    header, *rows = table_rows(old)
    ok = [row for row in rows if row[header.index("status")] == "ok"]
    skipped = [row for row in rows if row[header.index("status")] == "skipped"]
    assert ok and all(row[header.index("prefix")] == "0" and row[header.index("cached")] == "0.0" for row in ok)
    assert skipped and all(row[header.index("cached")] == "-" for row in skipped)
    assert len(write_plots(old, tmp_path)) == 2
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in old))
    assert main(["report", str(tmp_path)]) == 0


def test_plots_facet_by_prefix_when_points_have_one(tmp_path: Path) -> None:
    mixed = sample_records()
    for prefix in (0, 16):
        spec = PointSpec(32, 4, 2, math.inf, prefix_tokens=prefix, prefix_groups=1)
        outcome = PointOutcome(spec, (cached_request(0, prefix),), duration_s=0.5, retries=0)
        mixed.append(records.point_record(outcome, engine={"max_batch": 4}, target="t", server_info=INFO,
                                          run_id="r", started_at=0.0, warmup=0, max_error_rate=0.1))
    assert {p.name for p in write_plots(mixed, tmp_path)} == {THROUGHPUT_PLOT, LATENCY_PLOT}
