"""The audit of a sweep's results that the drills share (crash, replicas, compose, http): every point
of the grid recorded exactly once with request counts that add up, and, for a sweep that must
complete, every point ok with no failures but the streams a kill cut."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from drills.grid import Grid
from drills.row import Checks


def read_jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    """The records of a results folder's jsonl file (none if it is not there)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def lost_points(records: list[dict], grid: Grid) -> list[str]:  # type: ignore[type-arg]
    """Every point of `grid` exactly once, with counts that add up for each ok or failed point;
    what is wrong (each a lost result)."""
    keys = Counter((r["context_tokens"], r["max_new_tokens"], r["concurrency"]) for r in records)
    problems = [f"point {k} recorded {n} times" for k, n in keys.items() if n > 1]
    problems += [f"point {k} missing" for k in sorted(grid.points - set(keys))]
    for r in records:
        req = r["requests"]
        if r["status"] in ("ok", "failed") and not (
                req["sent"] == grid.requests_per_point == req["completed"] + req["failed"]):
            problems.append(f"point {r['context_tokens']}/{r['concurrency']} counts {req}")
    return problems


@dataclass(frozen=True)
class CompletedSweep:
    problems: list[str]  # lost_points: each a lost result
    failed_by_code: Counter[str]
    failed_by_reason: Counter[str]


def audit_completed_sweep(checks: Checks, records: list[dict], grid: Grid,  # type: ignore[type-arg]
                          cut_codes: set[str]) -> CompletedSweep:
    """What a sweep through kills and restarts that completed must show: no lost points, every
    point ok, and no requests failed but with a status in `cut_codes` (streams cut by a kill)."""
    problems = lost_points(records, grid)
    checks.expect(not problems, f"results: {problems[:3]}")
    bad = [f"{r['context_tokens']}/{r['concurrency']}: {r['status']} {r['reason']}" for r in records
           if r["status"] != "ok"]
    checks.expect(not bad, f"points not ok: {bad[:3]}")
    failed_by_code: Counter[str] = Counter()
    failed_by_reason: Counter[str] = Counter()
    for r in records:
        failed_by_code.update(r["requests"]["failed_by_code"])
        failed_by_reason.update(r["requests"]["failed_by_reason"])
    checks.expect(set(failed_by_code) <= cut_codes, f"failures other than cut streams: {dict(failed_by_code)}")
    return CompletedSweep(problems, failed_by_code, failed_by_reason)
