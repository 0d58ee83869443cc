"""results.jsonl: durable appends, torn-line repair, resume index, refusal of a non-empty DIR."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from bench_client.results import (
    RESULTS,
    SCHEMA,
    PointKey,
    ResultsDir,
    ResultsError,
    load_for_report,
    repair_torn_tail,
)


def record(context: int = 64, concurrency: int = 1, rate: float | str = "inf", engine: Any = None,
           status: str = "ok") -> dict[str, Any]:
    return {"schema": SCHEMA, "context_tokens": context, "max_new_tokens": 16, "concurrency": concurrency,
            "request_rate": rate, "engine": engine, "status": status, "reason": None, "reason_metadata": {},
            "message": "", "metrics": None, "requests": {"completed": 0, "failed": 0, "failed_by_code": {}}}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_append_is_one_fsynced_line_per_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    results = ResultsDir.open(tmp_path / "out", resume=False)
    results.append_point(record(64))
    after_first = len(synced)
    results.append_point(record(128))
    assert after_first >= 1 and len(synced) > after_first  # each point is fsynced as it is appended
    assert [r["context_tokens"] for r in lines(tmp_path / "out" / RESULTS)] == [64, 128]
    with pytest.raises(ValueError, match="already recorded"):
        results.append_point(record(64))


def test_resume_index_reads_recorded_points(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = ResultsDir.open(out, resume=False)
    results.append_point(record(64, engine={"max_batch": 8}))
    results.append_point(record(64, concurrency=4, rate=2.5))
    resumed = ResultsDir.open(out, resume=True)
    assert resumed.done == {
        PointKey('{"max_batch": 8}', 64, 16, 1, float("inf")),
        PointKey("null", 64, 16, 4, 2.5),
    }


def test_non_empty_dir_is_refused_without_resume(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ResultsDir.open(out, resume=False)  # an empty directory is fine
    (out / "something").write_text("x")
    with pytest.raises(ResultsError, match="not empty; pass --resume"):
        ResultsDir.open(out, resume=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResultsError, match="not a directory"):
        ResultsDir.open(tmp_path / "file", resume=True)


def test_torn_last_line_is_cut_with_a_warning(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ResultsDir.open(out, resume=False).append_point(record(64))
    with (out / RESULTS).open("a") as f:
        f.write('{"schema": "bench_client.point/1", "context_tok')  # killed mid-write
    with capture_logs() as logs:
        resumed = ResultsDir.open(out, resume=True)
    assert [r["context_tokens"] for r in resumed.records] == [64]
    assert (out / RESULTS).read_text().endswith("}\n")
    assert [e["event"] for e in logs] == ["torn_line_removed"]
    assert logs[0]["log_level"] == "warning" and logs[0]["file"].endswith(RESULTS)
    resumed.append_point(record(128))  # the file is valid JSONL again and appends go on
    assert [r["context_tokens"] for r in lines(out / RESULTS)] == [64, 128]


def test_last_line_with_newline_but_not_json_is_cut(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    path.write_text(json.dumps(record(64)) + "\n" + "\0\0\0\0\n")
    assert repair_torn_tail(path) == 5
    assert len(lines(path)) == 1


def test_only_line_torn(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    path.write_text('{"schema": ')
    assert repair_torn_tail(path) == len('{"schema": ')
    assert path.read_text() == ""
    assert repair_torn_tail(tmp_path / "missing.jsonl") == 0


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / RESULTS).write_text(json.dumps(record(64)) + "\nGARBAGE\n" + json.dumps(record(128)) + "\n")
    with pytest.raises(ResultsError, match="line 2 is not JSON"):
        ResultsDir.open(out, resume=True)


def test_report_reads_without_repairing(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    text = json.dumps(record(64)) + "\n" + '{"torn'
    path.write_text(text)
    with capture_logs() as logs:
        assert [r["context_tokens"] for r in load_for_report(path)] == [64]
    assert path.read_text() == text
    assert logs[0]["event"] == "torn_line_ignored"
    with pytest.raises(ResultsError, match="does not exist"):
        load_for_report(tmp_path / "nope" / RESULTS)


def test_detail_lines_are_written_as_they_go(tmp_path: Path) -> None:
    results = ResultsDir.open(tmp_path / "out", resume=False, detail=True)
    results.append_request({"index": 0, "status": "ok"})
    assert json.loads((tmp_path / "out" / "requests.jsonl").read_text())["index"] == 0
    results.close()


def test_prefix_settings_are_part_of_the_point_key_and_old_records_resume(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    old = record(64)  # written before prefix_tokens / prefix_groups existed: no such keys
    assert "prefix_tokens" not in old
    (out / RESULTS).write_text(json.dumps(old) + "\n")
    resumed = ResultsDir.open(out, resume=True)
    assert resumed.records == [old]
    # the old point reads as prefix 0, one group: the same point as a new one without a prefix ...
    assert resumed.done == {PointKey("null", 64, 16, 1, float("inf"), 0, 1)}
    assert PointKey("null", 64, 16, 1, float("inf")) in resumed.done
    with pytest.raises(ValueError, match="already recorded"):
        resumed.append_point({**record(64), "prefix_tokens": 0, "prefix_groups": 1})
    # ... and a point with a shared prefix is another point, recorded next to it, and so resumed
    resumed.append_point({**record(64), "prefix_tokens": 32, "prefix_groups": 1})
    resumed.append_point({**record(64), "prefix_tokens": 32, "prefix_groups": 4})
    again = ResultsDir.open(out, resume=True)
    assert again.done == {PointKey("null", 64, 16, 1, float("inf"), 0, 1),
                          PointKey("null", 64, 16, 1, float("inf"), 32, 1),
                          PointKey("null", 64, 16, 1, float("inf"), 32, 4)}
