"""Export a results directory in the shape of vLLM's `bench serve --save-result` JSON, or as CSV.

`python -m bench_client export RUN --format json|csv [--out FILE]`. One entry per recorded point, in
the order of results.jsonl; skipped and failed points too (`status`, `reason`; their metrics null).
Every entry of one export has the same keys. JSON: a list of objects. CSV: one row per point with the
header below (per-request lists left out; objects written as their JSON text, sorted keys; null as an
empty cell).

Fields vLLM writes, with the same names and units (ms for latencies, seconds for `duration`):
- `date`: the point's start, "%Y%m%d-%H%M%S" in UTC (vLLM: local time of the run).
- `endpoint_type`, `backend`: vLLM's backend name for what was measured: "openai" (OpenAI API,
  /v1/completions), "openai-chat" (/v1/chat/completions); "engine.v1" for our gRPC API (no vLLM name).
- `label`: the server: its [servers.NAME], else its target, else its API.
- `model_id`: the model the server reported (server_info.model); null where it could not be read.
- `tokenizer_id`: what counted the tokens (the record's `tokenizer`, else the server's own tokenizer).
- `num_prompts`: measured requests sent (warmup left out). `request_rate`: requests/s or "inf".
- `burstiness`: the gamma shape of the arrivals (1.0 = Poisson). `max_concurrency`: the concurrency.
- `duration`: seconds from the first send to the last token. `completed`, `failed`: request counts.
- `total_input_tokens`, `total_output_tokens`, `request_throughput`, `output_throughput`,
  `total_token_throughput` (per second); `request_goodput`: requests/s meeting every SLO (null
  without [slo]).
- For M in ttft, tpot, itl, e2el: `mean_M_ms`, `median_M_ms`, `std_M_ms` and `pP_M_ms` for each
  percentile P the run reported (the union over its points, keys as in the record: p50, p99.9).
  A value the record does not hold is null: `std_*` and percentiles other than 50/90/99 in records
  older than them (those knew median, p90, p99 only), everything of a skipped point.
- With requests.jsonl (`sweep --detail`), per measured request of the point in index order
  (absent without it, as vLLM leaves them out without --save-detailed):
  `input_lens` (prompt tokens as counted; the point's context_tokens for a request that got no
  answer), `output_lens`, `ttfts` (s), `itls` (per request its ITL gaps in s, from its streamed
  messages, as metrics.py's RequestTimeline.itls counts them), `latencies` (E2EL, s), `start_times`
  (Unix s), `errors` ("" when ok, else "CODE REASON: message"). A failed request that got no tokens reads as vLLM writes one: 0 tokens,
  ttft and latency 0.0, no itls, its error set. A truncated one keeps its timeline, error TRUNCATED.
vLLM's `max_output_tokens_per_s`, `max_concurrent_requests`, `rtfx`, `generated_texts`,
`queue_times` are not exported (the records do not hold them).

Fields of ours (not in vLLM's file):
- `export_schema`: "bench_client.export/1". `server`: the [servers.NAME] ("" for one unnamed server).
- `api`: "engine.v1" or "openai". `target`: the address. `engine`: the engine settings (object; null
  when the client targeted a running engine).
- `status`: "ok", "skipped" or "failed"; `reason`, `message`, `skip_code`: as in results.py.
- `dataset`, `endpoint`, `prompt_format`, `tokenizer`: the workload; `context_tokens`,
  `max_new_tokens` (0: the dataset's own lengths), `prefix_tokens`, `prefix_groups`.
- `duration_limit_s`: the point's time bound (workload.duration_s; null without one).
- `slo_ttft_ms`, `slo_tpot_ms`, `slo_e2el_ms`: the [slo] (null where not set); `good_requests`;
  `slo_attainment`: fraction 0..1 of measured requests meeting every SLO (null without [slo]).
- `search`: the SLO search step this point was a probe of (object; null otherwise).
- `sent`, `failed_by_code`, `failed_by_reason` (objects), `retries`, `warmup`, `truncated`.
- `total_cached_prompt_tokens`, `mean_cached_prompt_tokens`: from the engine's prefix cache.
- For M in engine_queue, engine_ttft (reported by the engine): `mean_M_ms`, `median_M_ms`, ... as above.
- `run_id`, `started_at`, `finished_at` (Unix s).

Keys absent from older records read as results.py and the defaults below say (dataset "random",
endpoint "completions", prompt_format "token_ids", burstiness 1.0, ...).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from bench_client.metrics import Arrival, RequestTimeline
from bench_client.results import REQUEST_SCHEMA, REQUESTS, RESULTS, ResultsError, engine_key, load_for_report

log = structlog.get_logger()

EXPORT_SCHEMA = "bench_client.export/1"
FORMATS = ("json", "csv")

# Top-level keys newer than the oldest records, and what their absence means.
DEFAULTS: Mapping[str, Any] = {
    "server": "", "api": "engine.v1", "prefix_tokens": 0, "prefix_groups": 1, "dataset": "random",
    "endpoint": "completions", "prompt_format": "token_ids", "tokenizer": "", "burstiness": 1.0,
    "duration_s": None, "slo": None, "search": None, "skip_code": None,
}
OLD_PERCENTILES = {"50": "median", "90": "p90", "99": "p99"}  # what records before `percentiles` knew
VLLM_LATENCIES = ("ttft", "tpot", "itl", "e2el")
ENGINE_LATENCIES = ("engine_queue", "engine_ttft")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
REQUEST_LISTS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")

THROUGHPUTS = ("total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
               "output_throughput", "total_token_throughput")  # metrics' keys, vLLM's names
VLLM_HEAD = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", *THROUGHPUTS)
OWN_FIELDS = ("export_schema", "server", "api", "target", "engine", "status", "reason", "message", "skip_code",
              "dataset", "endpoint", "prompt_format", "tokenizer", "context_tokens", "max_new_tokens",
              "prefix_tokens", "prefix_groups", "duration_limit_s", *(f"slo_{k}" for k in SLO_KEYS), "good_requests",
              "slo_attainment", "search", "sent", "failed_by_code", "failed_by_reason", "retries", "warmup",
              "truncated", "total_cached_prompt_tokens", "mean_cached_prompt_tokens")
OWN_TAIL = ("run_id", "started_at", "finished_at")


def with_defaults(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with each key newer than it (absent or null) set to what its absence means (DEFAULTS)."""
    return {**record, **{key: default if record.get(key) is None else record[key] for key, default in DEFAULTS.items()}}


def latency_fields(name: str, percentiles: Sequence[str]) -> list[str]:
    """vLLM's keys of one latency: mean, median, std, then pP for each percentile P."""
    return [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *(f"p{p}_{name}_ms" for p in percentiles)]


def field_names(percentiles: Sequence[str], *, detail: bool) -> list[str]:
    """Every key of an entry, in order; `detail` adds the per-request lists."""
    latencies = [f for name in (*VLLM_LATENCIES, *ENGINE_LATENCIES) for f in latency_fields(name, percentiles)]
    return [*VLLM_HEAD, *latencies, *(REQUEST_LISTS if detail else ()), *OWN_FIELDS, *OWN_TAIL]


def csv_field_names(percentiles: Sequence[str]) -> list[str]:
    """The CSV header: every key but the per-request lists."""
    return field_names(percentiles, detail=False)


def run_percentiles(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The percentile keys ("50", "99.9") any point of the run reported, in numeric order; 50/90/99 when none did."""
    found: set[str] = set()
    for record in records:
        metrics = record.get("metrics")
        if metrics:
            found.update(_percentiles_of(metrics["ttft_ms"]))
    return sorted(found or OLD_PERCENTILES, key=float)


def _percentiles_of(summary: Mapping[str, Any]) -> dict[str, float | None]:
    if "percentiles" in summary:
        return dict(summary["percentiles"])
    return {p: summary[key] for p, key in OLD_PERCENTILES.items()}


def _latency_values(name: str, summary: Mapping[str, Any] | None, percentiles: Sequence[str]) -> dict[str, Any]:
    keys = latency_fields(name, percentiles)
    if summary is None:
        return dict.fromkeys(keys)
    known = _percentiles_of(summary)
    return dict(zip(keys, [summary["mean"], summary["median"], summary.get("std"),
                           *(known.get(p) for p in percentiles)], strict=True))


def _backend(api: str, endpoint: str) -> str:
    if api != "openai":
        return api
    return "openai-chat" if endpoint == "chat" else "openai"


def _label(record: Mapping[str, Any]) -> str:
    if record["server"]:
        return str(record["server"])
    if record["engine"] is None and record.get("target"):
        return str(record["target"])
    return str(record["api"])


def entry(raw: Mapping[str, Any], percentiles: Sequence[str],
          requests: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One exported entry of a point record; `requests`: its measured request lines (None: no requests.jsonl)."""
    r = with_defaults(raw)
    m = r["metrics"]
    counts = r["requests"]
    info = r.get("server_info") or {}
    slo = r["slo"] or {}
    values: dict[str, Any] = {
        "date": datetime.fromtimestamp(r["started_at"], tz=UTC).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": _backend(r["api"], r["endpoint"]),
        "backend": _backend(r["api"], r["endpoint"]),
        "label": _label(r),
        "model_id": info.get("model") or None,
        "tokenizer_id": r["tokenizer"] or info.get("tokenizer") or None,
        "num_prompts": counts["sent"],
        "request_rate": r["request_rate"],
        "burstiness": r["burstiness"],
        "max_concurrency": r["concurrency"],
        "duration": m["duration_s"] if m else None,
        "completed": counts["completed"],
        "failed": counts["failed"],
        **{key: m.get(key) if m else None for key in THROUGHPUTS},
        "export_schema": EXPORT_SCHEMA,
        **{key: r.get(key) for key in ("server", "api", "target", "engine", "status", "reason", "message",
                                       "skip_code", "dataset", "endpoint", "prompt_format", "tokenizer",
                                       "context_tokens", "max_new_tokens", "prefix_tokens", "prefix_groups",
                                       "search", "run_id", "started_at", "finished_at")},
        "duration_limit_s": r["duration_s"],
        **{f"slo_{key}": slo.get(key) for key in SLO_KEYS},
        "good_requests": m.get("good_requests") if m else None,
        "slo_attainment": m.get("slo_attainment") if m else None,
        "sent": counts["sent"],
        "failed_by_code": counts["failed_by_code"],
        "failed_by_reason": counts.get("failed_by_reason", {}),
        "retries": counts["retries"],
        "warmup": counts["warmup"],
        "truncated": counts.get("truncated", 0),
        "total_cached_prompt_tokens": m.get("total_cached_prompt_tokens", 0) if m else None,
        "mean_cached_prompt_tokens": m.get("mean_cached_prompt_tokens", 0.0 if m["completed"] else None)
        if m else None,
    }
    for name in (*VLLM_LATENCIES, *ENGINE_LATENCIES):
        values.update(_latency_values(name, m[f"{name}_ms"] if m else None, percentiles))
    if requests is not None:
        values.update(request_lists(requests))
    return {key: values[key] for key in field_names(percentiles, detail=requests is not None)}


def request_lists(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """vLLM's per-request lists of a point's measured requests (see the module docstring)."""
    lists: dict[str, list[Any]] = {key: [] for key in REQUEST_LISTS}
    for q in requests:
        answered = q.get("ttft_s") is not None
        lists["input_lens"].append(q.get("prompt_tokens") if q.get("prompt_tokens") is not None
                                   else q["context_tokens"])
        lists["output_lens"].append(q.get("output_tokens") or 0)
        lists["ttfts"].append(q["ttft_s"] if answered else 0.0)
        lists["itls"].append(_itls(q["messages"]) if answered else [])
        lists["latencies"].append(q["e2el_s"] if answered else 0.0)
        lists["start_times"].append(q["sent_at"])
        lists["errors"].append(_error(q))
    return lists


def _itls(messages: Sequence[Sequence[float]]) -> list[float]:
    """The gaps between a request's tokens from its [arrival_s, tokens] messages, as metrics.py counts them."""
    timeline = RequestTimeline(sent_at=0.0, arrivals=tuple(Arrival(at, int(n)) for at, n in messages), prompt_tokens=0)
    return timeline.itls()


def _error(request: Mapping[str, Any]) -> str:
    if request["status"] == "ok":
        return ""
    if request["status"] == "truncated":
        return "TRUNCATED"
    head = " ".join(str(part) for part in (request.get("code"), request.get("reason")) if part)
    return f"{head}: {request['message']}" if request.get("message") else head or "failed"


def _request_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What ties a request line to its point: the sweep run and the point's parameters."""
    return (record["run_id"], record.get("server") or "", engine_key(record["engine"]), int(record["context_tokens"]),
            int(record["max_new_tokens"]), int(record["concurrency"]), float(record["request_rate"]),
            int(record.get("prefix_tokens", 0)), int(record.get("prefix_groups", 1)))


def load_requests(path: Path) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """The measured request lines of a requests.jsonl by point (_request_key), each point's in index
    order; read without changing the file: a torn last line is skipped with a warning."""
    lines = path.read_bytes().split(b"\n")
    by_point: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            request = json.loads(line)
        except ValueError as err:
            if number < len(lines) - 1:
                raise ResultsError(f"{path} line {number} is not JSON ({err})") from err
            log.warning("torn_line_ignored", file=str(path), line=number)
            continue
        if not isinstance(request, dict) or request.get("schema") != REQUEST_SCHEMA:
            schema = request.get("schema") if isinstance(request, dict) else None
            raise ResultsError(f"{path} line {number} has schema {schema!r}, expected {REQUEST_SCHEMA!r}")
        if request.get("warmup"):
            continue
        try:
            by_point.setdefault(_request_key(request), []).append(request)
        except (KeyError, TypeError, ValueError) as err:
            raise ResultsError(f"{path} line {number} lacks a point key or has a malformed one: {err!r}") from err
    for requests in by_point.values():
        requests.sort(key=lambda q: q.get("index", 0))
    return by_point


def _matches(request: Mapping[str, Any], record: Mapping[str, Any]) -> bool:
    """Request lines that carry the workload's dataset or endpoint must carry the point's."""
    return all(request.get(key, record[key]) == record[key] for key in ("dataset", "endpoint"))


@dataclass(frozen=True)
class RunExport:
    """The entries of one results directory and the percentiles (keys) their latency fields carry."""

    entries: list[dict[str, Any]]
    percentiles: list[str]

    def to_json(self) -> str:
        return json.dumps(self.entries, indent=2, allow_nan=False) + "\n"

    def to_csv(self) -> str:
        """One row per entry under csv_field_names(percentiles)."""
        header = csv_field_names(self.percentiles)
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(header)
        for item in self.entries:
            writer.writerow([_cell(item[key]) for key in header])
        return out.getvalue()

    def render(self, fmt: str) -> str:
        """The export as text in `fmt` ("json" or "csv")."""
        if fmt not in FORMATS:
            raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}")
        return self.to_json() if fmt == "json" else self.to_csv()


def load_run(run: Path) -> list[dict[str, Any]]:
    """The point records of a results directory, read without changing it; ResultsError names the path."""
    if not run.is_dir():
        raise ResultsError(f"{str(run)!r} is not a directory: is it a sweep's --out directory?")
    return load_for_report(run / RESULTS)


def export_run(run: Path) -> RunExport:
    """The export of a results directory; ResultsError names the path when it cannot be read."""
    records = load_run(run)
    requests = load_requests(run / REQUESTS) if (run / REQUESTS).exists() else None
    try:
        percentiles = run_percentiles(records)
    except (KeyError, TypeError, AttributeError) as err:
        raise ResultsError(f"{run / RESULTS}: a point's metrics lack or mangle a latency ({err!r})") from err
    entries = []
    for number, raw in enumerate(records, start=1):
        try:
            point_requests = None
            if requests is not None:
                record = with_defaults(raw)
                point_requests = [q for q in requests.get(_request_key(record), []) if _matches(q, record)]
            entries.append(entry(raw, percentiles, point_requests))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ResultsError(f"{run / RESULTS} point {number}: the record lacks or mangles a field "
                               f"({type(err).__name__}: {err})") from err
    return RunExport(entries, percentiles)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)
