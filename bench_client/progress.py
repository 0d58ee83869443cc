"""What the user sees while a sweep runs: a rich progress bar on a TTY, log lines otherwise.

Point events (`point_started`, `point_done`, `point_skipped`) are logged in both cases; the bar
adds points done, the current point and the requests in flight.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

import structlog
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from bench_client.point import PointSpec, RequestResult

log = structlog.get_logger()


class SweepProgress:
    """Point-level progress for the sweep runner and request-level progress for the point runner."""

    def __init__(self, *, enabled: bool | None = None) -> None:
        self._enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._in_flight = 0
        self._current = ""

    def __enter__(self) -> SweepProgress:
        if self._enabled:
            self._progress = Progress(
                TextColumn("[bold]points"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[current]}  in flight: {task.fields[in_flight]}"),
                console=Console(stderr=True), transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("sweep", total=None, current="", in_flight=0)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)

    def sweep_started(self, total: int, already_done: int) -> None:
        log.info("sweep_started", points=total, already_recorded=already_done)
        self._update(total=total, completed=already_done)

    def point_started(self, spec: PointSpec, engine: dict[str, Any] | None) -> None:
        self._current = f"{spec.tag()} {engine or ''}"
        self._in_flight = 0
        log.info("point_started", point=spec.tag(), engine=engine)
        self._update()

    def point_recorded(self, record: dict[str, Any]) -> None:
        fields = {k: record[k] for k in ("context_tokens", "max_new_tokens", "concurrency", "request_rate",
                                         "prefix_tokens", "prefix_groups")}
        if record["status"] == "skipped":
            log.warning("point_skipped", **fields, engine=record["engine"], reason=record["reason"],
                        reason_metadata=record["reason_metadata"], message=record["message"],
                        without_sending=record["skipped_without_sending"])
        else:
            metrics = record["metrics"]
            level = log.warning if record["status"] == "failed" else log.info
            level("point_done", **fields, engine=record["engine"], status=record["status"],
                  completed=record["requests"]["completed"], failed_by_code=record["requests"]["failed_by_code"],
                  output_throughput=round(metrics["output_throughput"], 2),
                  ttft_median_ms=metrics["ttft_ms"]["median"], tpot_median_ms=metrics["tpot_ms"]["median"],
                  cached_prompt_tokens_mean=metrics["mean_cached_prompt_tokens"])
        self._in_flight = 0  # a skip or stop ends a point's requests without finishing them
        self._update(advance=1)

    # PointObserver
    def request_started(self, spec: PointSpec) -> None:
        self._in_flight += 1
        self._update()

    def request_finished(self, spec: PointSpec, outcome: RequestResult) -> None:
        self._in_flight -= 1
        self._update()

    def _update(self, advance: int = 0, **fields: Any) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=advance, current=self._current, in_flight=self._in_flight,
                                  **fields)
