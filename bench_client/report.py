"""The report: a table of every point (skipped and failed ones with their reason) and PNG plots.

Plots, one line per engine configuration (and per fixed parameter, named in the legend):
- `throughput_vs_concurrency.png`: output token throughput against concurrency.
- `latency_vs_context.png`: median TTFT and median TPOT against context length.
Only `ok` and `failed` points with completed requests are plotted (and only request_rate "inf"
for the concurrency plot when several rates were swept).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display: set before pyplot is imported
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

THROUGHPUT_PLOT = "throughput_vs_concurrency.png"
LATENCY_PLOT = "latency_vs_context.png"

_STATUS_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red"}


def _engine_label(engine: dict[str, Any] | None) -> str:
    if engine is None:
        return "target"
    return ",".join(f"{k}={v}" for k, v in sorted(engine.items())) or "engine"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _sort_key(record: dict[str, Any]) -> tuple[str, int, int, int, float]:
    rate = record["request_rate"]
    return (_engine_label(record["engine"]), record["context_tokens"], record["max_new_tokens"],
            record["concurrency"], float("inf") if rate == "inf" else float(rate))


def build_table(records: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="sweep results", show_lines=False)
    table.caption = "latencies in ms (p50 = median); eng = reported by the engine; failed = by status code"
    for name in ("engine", "ctx", "new", "conc", "rate", "status", "ok", "failed", "out tok/s", "req/s",
                 "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "eng queue p50", "eng TTFT p50"):
        table.add_column(name, justify="left" if name in ("engine", "status", "failed") else "right")
    table.add_column("reason", justify="left", overflow="fold", min_width=30)
    for r in sorted(records, key=_sort_key):
        m = r["metrics"]
        requests = r["requests"]
        failed = ", ".join(f"{code}:{n}" for code, n in requests["failed_by_code"].items()) or "0"
        reason = " ".join([r["reason"] or "", *(f"{k}={v}" for k, v in sorted(r["reason_metadata"].items()))])
        if r.get("skipped_without_sending"):
            reason += " (not sent)"
        row = [_engine_label(r["engine"]), str(r["context_tokens"]), str(r["max_new_tokens"]),
               str(r["concurrency"]), str(r["request_rate"]),
               f"[{_STATUS_STYLE.get(r['status'], 'white')}]{r['status']}[/]",
               str(requests["completed"]), failed]
        if m is None:
            row += ["-"] * 8
        else:
            row += [_fmt(m["output_throughput"]), _fmt(m["request_throughput"], 2),
                    _fmt(m["ttft_ms"]["median"]), _fmt(m["ttft_ms"]["p99"]), _fmt(m["tpot_ms"]["median"], 2),
                    _fmt(m["itl_ms"]["p99"], 2), _fmt(m["engine_queue_ms"]["median"]),
                    _fmt(m["engine_ttft_ms"]["median"])]
        table.add_row(*row, reason)
    return table


def print_table(records: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    (console or Console(width=200)).print(build_table(records))


def write_plots(records: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the PNG plots into out_dir; returns their paths (none when no point has metrics)."""
    measured = [r for r in records if r["metrics"] is not None and r["metrics"]["completed"] > 0]
    if not measured:
        return []
    return [_throughput_plot(measured, out_dir / THROUGHPUT_PLOT), _latency_plot(measured, out_dir / LATENCY_PLOT)]


def _throughput_plot(records: Sequence[dict[str, Any]], path: Path) -> Path:
    rates = {r["request_rate"] for r in records}
    if "inf" in rates and len(rates) > 1:
        records = [r for r in records if r["request_rate"] == "inf"]
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        label = f"{_engine_label(r['engine'])} ctx={r['context_tokens']} new={r['max_new_tokens']}"
        if len(rates) > 1 and "inf" not in rates:
            label += f" rate={r['request_rate']}"
        lines[label].append((r["concurrency"], r["metrics"]["output_throughput"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _latency_plot(records: Sequence[dict[str, Any]], path: Path) -> Path:
    lines: dict[str, list[tuple[int, float | None, float | None]]] = defaultdict(list)
    for r in records:
        label = (f"{_engine_label(r['engine'])} conc={r['concurrency']} new={r['max_new_tokens']} "
                 f"rate={r['request_rate']}")
        lines[label].append((r["context_tokens"], r["metrics"]["ttft_ms"]["median"], r["metrics"]["tpot_ms"]["median"]))
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(12, 5))
    for label, points in sorted(lines.items()):
        points.sort()
        ttft_ax.plot([p[0] for p in points if p[1] is not None], [p[1] for p in points if p[1] is not None],
                     marker="o", label=label)
        tpot_ax.plot([p[0] for p in points if p[2] is not None], [p[2] for p in points if p[2] is not None],
                     marker="o", label=label)
    for ax, name in ((ttft_ax, "median TTFT (ms)"), (tpot_ax, "median TPOT (ms)")):
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(name)
        ax.set_title(f"{name} vs context length")
        ax.grid(True, alpha=0.3)
    ttft_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
