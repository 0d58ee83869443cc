"""The results directory: durable, append-only JSON lines that survive a kill at any instant.

Files in DIR:
- `results.jsonl`: one JSON object per point and nothing else, appended, flushed and fsynced as
  each point ends. A point is recorded once; `--resume` runs only the points not recorded yet.
- `engines.jsonl`: one object per managed engine run (its settings, exit code, log tail).
- `requests.jsonl`: with `--detail`, one object per request as it ends (flushed as it goes,
  fsynced with its point). Lines of a point cut short by a crash may be followed, after
  `--resume`, by the lines of its rerun: they differ in `run_id`.
- `engine-*.log`: the managed engines' own output.

A kill can leave the last line of a file torn (no trailing newline, or not JSON). Opening the
directory cuts such a line off with a warning; it is never read as a result.

Point record schema `bench_client.point/1` (keys always present unless marked optional):
- `schema`: "bench_client.point/1".
- `server`: the [servers.NAME] the point ran against ("" for a sweep of one unnamed server), `api`:
  "engine.v1" or "openai". Optional: absent in older records, read as "" and "engine.v1".
- `context_tokens`, `max_new_tokens`, `concurrency`: ints; `request_rate`: requests/s or "inf".
- `prefix_tokens`, `prefix_groups`: ints, the workload's shared prompt prefixes (prompts.py); optional,
  absent in records written before they existed and read as 0 and 1.
- `dataset` ("random", "sharegpt" or "jsonl:PATH"), `endpoint` ("completions" or "chat"),
  `prompt_format` ("text" or "token_ids"), `tokenizer` (what sized the prompts and counted answers
  without usage: "smollm2 (GGUF ...)", "tokenizer.json PATH", "the tokenize endpoint of URL", or null
  for token ids), `range_ratio`, `burstiness`, `duration_s` (null: no time bound), `slo` (the [slo]
  objectives in ms, or null), `search` (a probe of an SLO search: {"over", "step", "low", "high",
  "attainment"}; else null). With a dataset, `context_tokens` is 0 (the dataset's own lengths), and
  so is `max_new_tokens` where the workload does not override the dataset's. Optional: absent in
  older records, read as random token ids, completions, no SLO.
- `status`: "ok", "skipped" or "failed".
- `reason`: null for "ok"; for "skipped" the server's reason as the adapter classified it:
  CONTEXT_LENGTH_EXCEEDED (the prompt does not fit: engine.v1's ErrorInfo, or an HTTP 400/422 whose
  body says so), INVALID_FIELD (engine.v1) or BAD_REQUEST (any other HTTP 400/422); `skip_code`:
  the status it came with ("INVALID_ARGUMENT", "HTTP_400", ...; null when not sent; optional);
  for "failed" `ERROR_RATE_EXCEEDED`. `reason_metadata`: the ErrorInfo metadata (object of strings),
  `message`: the status message or a sentence; `skipped_without_sending`: true when an earlier
  CONTEXT_LENGTH_EXCEEDED (smaller or equal context, same max_new_tokens) decided the skip; its
  `reason_metadata` is that refusal's, with `promptTokens` set to this point's context.
- `engine`: the engine configuration (object of the [engine.grid] settings, {} for one without a
  grid), or null when the client targets a running engine.
- `target`, `server_info` (GetServerInfo as an object; null if it could not be read).
- `requests`: {"sent": n, "completed": n, "failed": n, "failed_by_code": {"ABORTED": n, ...},
  "failed_by_reason": {"SEQUENCE_ABORTED": n, ...}, "retries": n, "warmup": n, "by_replica": {"host:port": n},
  "truncated": n, "connection_resends": n}. Codes are gRPC names, "HTTP_<status>" over HTTP, or TRUNCATED for a request the server
  ended early without an error (counted failed; `truncated` is their number, optional in older records).
  `by_replica`: the replica (its `engine-replica` header, host:port) that answered each measured
  request's last attempt, "none" for a request that reached none; sums to `sent`. Optional: absent
  in older records.
- `metrics`: null when skipped, else the object of metrics.PointMetrics (latencies in ms with mean,
  median, p90, p99; throughputs per second; engine-reported queue time and TTFT;
  `total_cached_prompt_tokens` and `mean_cached_prompt_tokens` per completed request, the prompt
  tokens the engine's prefix cache supplied: optional, absent in older records and read as 0). Each
  latency also has `std` and `percentiles` ({"50": ms, "95": ms, ...}: workload.percentiles);
  `output_token_source` ({"usage": n, "tokenizer": n, "stream": n}: where each completed request's
  output count came from); `good_requests`, `request_goodput` and `slo_attainment` (null without
  [slo]). Optional: absent in older records. `connection_resends` counts the requests the HTTP
  adapter sent once more on a fresh connection because a pooled keep-alive connection was dead
  before any answer: they are not retries, and the policy never saw them.
- `started_at`, `finished_at`: Unix seconds; `run_id`: the sweep run that recorded the point.

A request retried by the policy (QUEUE_FULL, UNAVAILABLE before its first token: at once on another
replica when one serves) is timed from its last attempt; `requests.retries` counts the extra attempts. Warmup requests are never measured.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

log = structlog.get_logger()

SCHEMA = "bench_client.point/1"
ENGINE_SCHEMA = "bench_client.engine/1"
REQUEST_SCHEMA = "bench_client.request/1"
RESULTS = "results.jsonl"
ENGINES = "engines.jsonl"
REQUESTS = "requests.jsonl"


class ResultsError(Exception):
    """The results directory cannot be used as asked; the message names the path and the problem."""


@dataclass(frozen=True, order=True)
class PointKey:
    """What identifies a point across runs: the engine configuration and the point's parameters."""

    engine: str  # canonical JSON of the engine settings, "null" for an unmanaged target
    context_tokens: int
    max_new_tokens: int
    concurrency: int
    request_rate: float
    prefix_tokens: int = 0
    prefix_groups: int = 1
    server: str = ""  # the [servers.NAME] name; "" for a sweep of one unnamed server

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> PointKey:
        return cls(
            server=record.get("server") or "",  # absent in records older than [servers]
            engine=engine_key(record["engine"]),
            context_tokens=int(record["context_tokens"]),
            max_new_tokens=int(record["max_new_tokens"]),
            concurrency=int(record["concurrency"]),
            request_rate=rate_from_json(record["request_rate"]),
            prefix_tokens=int(record.get("prefix_tokens", 0)),  # absent in records older than the key
            prefix_groups=int(record.get("prefix_groups", 1)),
        )


def engine_key(settings: Mapping[str, Any] | None) -> str:
    return json.dumps(settings, sort_keys=True)


def rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_from_json(value: float | str) -> float:
    return float(value)  # rate_to_json's "inf" reads back as math.inf


class ResultsDir:
    """An opened results directory: the records already there, and durable appends."""

    def __init__(self, path: Path, records: list[dict[str, Any]], detail: bool) -> None:
        self.path = path
        self.records = records
        self.done: set[PointKey] = {PointKey.of_record(r) for r in records}
        self._detail: IO[str] | None = (path / REQUESTS).open("a", encoding="utf-8") if detail else None

    @classmethod
    def open(cls, path: Path, *, resume: bool, detail: bool = False) -> ResultsDir:
        """Open DIR for a sweep: refuse a non-empty one unless resuming; repair torn last lines."""
        if path.exists() and not path.is_dir():
            raise ResultsError(f"--out {str(path)!r} exists and is not a directory")
        if path.is_dir() and any(path.iterdir()) and not resume:
            raise ResultsError(f"--out {str(path)!r} is not empty; pass --resume to continue the sweep "
                               "recorded there, or choose another directory")
        path.mkdir(parents=True, exist_ok=True)
        for name in (RESULTS, ENGINES, REQUESTS):
            repair_torn_tail(path / name)
        return cls(path, read_records(path / RESULTS), detail)

    def append_point(self, record: Mapping[str, Any]) -> None:
        if record.get("schema") != SCHEMA:
            raise ValueError(f"point record schema must be {SCHEMA!r}, got {record.get('schema')!r}")
        key = PointKey.of_record(record)
        if key in self.done:
            raise ValueError(f"point {key} is already recorded in {self.path / RESULTS}")
        self.sync_detail()  # the point's request lines are durable before the point itself
        append_durably(self.path / RESULTS, record)
        self.records.append(dict(record))
        self.done.add(key)

    def append_engine(self, record: Mapping[str, Any]) -> None:
        append_durably(self.path / ENGINES, {"schema": ENGINE_SCHEMA, **record})

    def append_request(self, record: Mapping[str, Any]) -> None:
        if self._detail is None:
            return
        self._detail.write(json.dumps({"schema": REQUEST_SCHEMA, **record}, allow_nan=False) + "\n")
        self._detail.flush()

    def sync_detail(self) -> None:
        if self._detail is not None:
            self._detail.flush()
            os.fsync(self._detail.fileno())

    def close(self) -> None:
        if self._detail is not None:
            self.sync_detail()
            self._detail.close()
            self._detail = None


def append_durably(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line with a single write, then flush and fsync it."""
    line = json.dumps(record, allow_nan=False, sort_keys=True) + "\n"
    new = not path.exists()
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    if new:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def repair_torn_tail(path: Path) -> int:
    """Cut a torn last line (no newline, or not a JSON object) off `path`; returns the bytes removed."""
    if not path.exists():
        return 0
    with path.open("r+b") as f:
        data = f.read()
        keep = len(data)
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1  # 0 when the only line is torn
        if keep > 0:
            last_start = data.rfind(b"\n", 0, keep - 1) + 1
            if not _is_json_object(data[last_start:keep]):
                keep = last_start
        if keep == len(data):
            return 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    removed = len(data) - keep
    log.warning("torn_line_removed", file=str(path), bytes_removed=removed,
                line_start=data[keep:keep + 80].decode("utf-8", errors="replace"))
    return removed


def _is_json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return False


def read_records(path: Path) -> list[dict[str, Any]]:
    """The point records of a results.jsonl whose tail is already repaired."""
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ResultsError(f"{path} line {number} is not JSON ({err}); only a torn last line is "
                                   "repaired, so this file was changed by something else") from err
            if not isinstance(record, dict) or record.get("schema") != SCHEMA:
                schema = record.get("schema") if isinstance(record, dict) else None
                raise ResultsError(f"{path} line {number} has schema {schema!r}, expected {SCHEMA!r}")
            records.append(record)
    return records


def load_for_report(path: Path) -> list[dict[str, Any]]:
    """Read results.jsonl without changing it: a torn last line is skipped with a warning."""
    if not path.exists():
        raise ResultsError(f"{path} does not exist: is {str(path.parent)!r} a sweep's --out directory?")
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        if not _is_json_object(line):
            if number < len(lines) - 1:
                raise ResultsError(f"{path} line {number} is not a JSON object")
            log.warning("torn_line_ignored", file=str(path), line=number)
            continue
        record = json.loads(line)
        if record.get("schema") != SCHEMA:
            raise ResultsError(f"{path} line {number} has schema {record.get('schema')!r}, expected {SCHEMA!r}")
        records.append(record)
    return records
