"""results.jsonl in the corners that test_bench_results.py leaves open: which torn or corrupt tails
are cut and which are errors, the exact messages and log fields, the canonical lines, and the
detail file's lifecycle (found by `make mutate`, docs/mutation-testing.md)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from bench_client.results import (
    ENGINES,
    REQUESTS,
    RESULTS,
    SCHEMA,
    PointKey,
    ResultsDir,
    ResultsError,
    engine_key,
    load_for_report,
    rate_from_json,
    rate_to_json,
    read_records,
    repair_torn_tail,
)


def record(context: int = 64, **extra: Any) -> dict[str, Any]:
    return {"schema": SCHEMA, "context_tokens": context, "max_new_tokens": 16, "concurrency": 1,
            "request_rate": "inf", "engine": None, "status": "ok", **extra}


def line(context: int = 64) -> bytes:
    return json.dumps(record(context)).encode() + b"\n"


def test_engine_key_is_canonical_and_rates_round_trip() -> None:
    assert engine_key({"max_batch": 8, "dtype": "float32"}) == '{"dtype": "float32", "max_batch": 8}'
    assert engine_key({"b": 1, "a": 2}) == engine_key({"a": 2, "b": 1})
    assert engine_key(None) == "null"
    assert (rate_to_json(math.inf), rate_to_json(2.5)) == ("inf", 2.5)
    assert (rate_from_json("inf"), rate_from_json(2.5), rate_from_json(3)) == (math.inf, 2.5, 3.0)
    key = PointKey.of_record({**record(), "engine": {"b": 1, "a": 2}, "request_rate": 1.5})
    assert key == PointKey('{"a": 2, "b": 1}', 64, 16, 1, 1.5)
    # the [servers.NAME] a point ran against is part of its key; records older than [servers] have none
    assert PointKey.of_record({**record(), "server": "llama"}).server == "llama"
    assert PointKey.of_record({**record(), "server": None}).server == ""


TAILS = [
    # (file content, what repair keeps)
    (line(1), line(1)),
    (b"", b""),
    (line(1) + line(2) + b'{"schema": "bench', line(1) + line(2)),  # torn after several lines
    (line(1) + line(2)[:-1], line(1)),  # a whole object without its newline was still cut short
    (line(1) + b"\n", line(1)),  # a blank last line
    (line(1) + b"\0\0\0\0\n" + b'{"tor', line(1)),  # a zeroed line, then a torn one: both go
    (b"\n", b""),
    (b"\n" + b'{"tor', b""),
    (b"[1, 2]\n", b""),  # JSON, but not an object
    (b"\n\0\0\n", b"\n"),  # only the last line is judged
]


@pytest.mark.parametrize(("content", "kept"), TAILS, ids=range(len(TAILS)))
def test_repair_keeps_exactly_the_whole_records(tmp_path: Path, content: bytes, kept: bytes) -> None:
    path = tmp_path / RESULTS
    path.write_bytes(content)
    with capture_logs() as logs:
        removed = repair_torn_tail(path)
    assert path.read_bytes() == kept
    assert removed == len(content) - len(kept)
    assert [e["event"] for e in logs] == (["torn_line_removed"] if removed else [])


def test_repair_logs_the_size_and_the_start_of_what_it_cut(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    torn = b'{"message": "' + b"\xff\xfe" + b"x" * 100
    path.write_bytes(line(1) + torn)
    with capture_logs() as logs:
        assert repair_torn_tail(path) == len(torn)
    (event,) = logs
    assert (event["file"], event["bytes_removed"], event["log_level"]) == (str(path), len(torn), "warning")
    assert event["line_start"] == torn[:80].decode("utf-8", errors="replace")  # 80 bytes, undecodable ones replaced
    assert "\ufffd" in event["line_start"]


def test_open_creates_missing_parents_and_no_detail_file_unless_asked(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out"
    results = ResultsDir.open(out, resume=False)
    results.append_request({"index": 0})  # without detail, request lines are not kept
    results.close()
    results.close()
    assert out.is_dir() and not (out / REQUESTS).exists()


def test_refusals_name_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResultsError) as caught:
        ResultsDir.open(tmp_path / "file", resume=True)
    assert str(caught.value) == f"--out {str(tmp_path / 'file')!r} exists and is not a directory"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ResultsError) as caught:
        ResultsDir.open(tmp_path / "full", resume=False)
    assert str(caught.value) == (f"--out {str(tmp_path / 'full')!r} is not empty; pass --resume to continue the "
                                 "sweep recorded there, or choose another directory")


def test_points_are_canonical_lines_and_refuse_nan_and_other_schemas(tmp_path: Path) -> None:
    results = ResultsDir.open(tmp_path / "out", resume=False)
    first = {"status": "ok", **record(64)}  # keys out of order
    results.append_point(first)
    assert (tmp_path / "out" / RESULTS).read_text() == json.dumps(first, sort_keys=True) + "\n"
    assert results.records == [first]
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        results.append_point(record(128, metrics={"ttft": math.nan}))
    with pytest.raises(ValueError) as caught:
        results.append_point({**record(256), "schema": "other/1"})
    assert str(caught.value) == "point record schema must be 'bench_client.point/1', got 'other/1'"
    assert len(read_records(tmp_path / "out" / RESULTS)) == 1


def test_a_new_file_fsyncs_its_directory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directories: list[bool] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (directories.append(stat.S_ISDIR(os.fstat(fd).st_mode)),
                                                 real_fsync(fd)))
    results = ResultsDir.open(tmp_path / "out", resume=False)
    results.append_point(record(64))
    assert directories.count(True) == 1  # the new results.jsonl's directory entry is durable
    results.append_point(record(128))
    assert directories.count(True) == 1


def test_engine_and_request_lines_carry_their_schemas(tmp_path: Path) -> None:
    results = ResultsDir.open(tmp_path / "out", resume=False, detail=True)
    results.append_engine({"exit_code": 0})
    results.append_request({"index": 0, "status": "ok"})
    with pytest.raises(ValueError, match="Out of range float"):
        results.append_request({"index": 1, "ttft": math.inf})
    results.close()
    results.append_request({"index": 2})  # after close: nothing more is written
    engines = [json.loads(x) for x in (tmp_path / "out" / ENGINES).read_text().splitlines()]
    requests = [json.loads(x) for x in (tmp_path / "out" / REQUESTS).read_text().splitlines()]
    assert engines == [{"schema": "bench_client.engine/1", "exit_code": 0}]
    assert requests == [{"schema": "bench_client.request/1", "index": 0, "status": "ok"}]


@pytest.mark.parametrize(("bad", "message"), [
    (b'{"schema": "other/1"}\n', "line 2 has schema 'other/1', expected 'bench_client.point/1'"),
    (b"[1, 2]\n", "line 2 has schema None, expected 'bench_client.point/1'"),
])
def test_resume_refuses_records_of_another_schema(tmp_path: Path, bad: bytes, message: str) -> None:
    path = tmp_path / RESULTS
    path.write_bytes(line(1) + bad + line(2))
    with pytest.raises(ResultsError) as caught:
        read_records(path)
    assert str(caught.value) == f"{path} {message}"


def test_corrupt_middle_line_message(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    path.write_bytes(line(1) + b"GARBAGE\n" + line(2))
    with pytest.raises(ResultsError) as caught:
        read_records(path)
    assert str(caught.value).startswith(f"{path} line 2 is not JSON (")
    assert str(caught.value).endswith("); only a torn last line is repaired, so this file was changed by something else")


def test_report_reads_around_blank_lines_and_names_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    path.write_bytes(line(1) + b"\n" + line(2) + b"\0\0\0\0\n")  # a blank line; a zeroed last line
    with capture_logs() as logs:
        assert [r["context_tokens"] for r in load_for_report(path)] == [1, 2]
    assert [(e["event"], e["file"], e["line"]) for e in logs] == [("torn_line_ignored", str(path), 4)]
    assert path.read_bytes() == line(1) + b"\n" + line(2) + b"\0\0\0\0\n"
    for after in (line(2), line(2) + line(3)):  # only the last line may be torn
        path.write_bytes(line(1) + b"GARBAGE\n" + after)
        with pytest.raises(ResultsError) as caught:
            load_for_report(path)
        assert str(caught.value) == f"{path} line 2 is not a JSON object"
    path.write_bytes(line(1) + b'{"schema": "other/1"}\n')
    with pytest.raises(ResultsError) as caught:
        load_for_report(path)
    assert str(caught.value) == f"{path} line 2 has schema 'other/1', expected 'bench_client.point/1'"
    with pytest.raises(ResultsError) as caught:
        load_for_report(tmp_path / "nope" / RESULTS)
    assert str(caught.value) == (f"{tmp_path / 'nope' / RESULTS} does not exist: is {str(tmp_path / 'nope')!r} "
                                 "a sweep's --out directory?")
