"""The report: a table of every point (skipped and failed ones with their reason) and PNG plots.

The table's first column is the server ([servers.NAME]; for a sweep of one unnamed server, its target,
or its API when the client starts it).
Plots, one line per server and engine configuration, one small panel per value of the other parameters:
- `throughput_vs_concurrency.png`: output token throughput against concurrency.
- `latency_vs_context.png`: median TTFT and median TPOT against context length.
Only points with completed requests are plotted (skipped ones have no metrics). When some point has
a shared prompt prefix (workload.prefix_tokens), the prefix and its groups are facets too. A
dataset's points (context 0: the dataset's own lengths) show the dataset's name as their context,
and "own" as their new tokens where the dataset gives them; they have no latency-vs-context plot.
With [slo], the table adds goodput (good requests/s) and SLO attainment.

Records written before `prefix_tokens`, `prefix_groups` and the cached prompt tokens existed read as
prefix 0, one group and 0 cached tokens (what those engines and clients did).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench_client.figures import pyplot

THROUGHPUT_PLOT = "throughput_vs_concurrency.png"
LATENCY_PLOT = "latency_vs_context.png"

_STATUS_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red"}


def _engine_label(engine: dict[str, Any] | None) -> str:
    if engine is None:
        return "target"
    return ",".join(f"{k}={v}" for k, v in sorted(engine.items())) or "engine"


def _server_label(record: dict[str, Any]) -> str:
    """The [servers.NAME] of the point; for a sweep of one unnamed server, its target when it runs
    already, else its API (a managed server's address changes with each engine configuration)."""
    if record.get("server"):
        return str(record["server"])
    if record["engine"] is None and record.get("target"):
        return str(record["target"])
    return str(record.get("api") or "engine.v1")


def _line_label(record: dict[str, Any]) -> str:
    """One line per server and engine configuration in the plots."""
    engine = _engine_label(record["engine"])
    return f"{record['server']} {engine}" if record.get("server") else engine


def _reason_label(record: dict[str, Any]) -> str:
    """The reason with its metadata, and the code it came with: a context skip and another refusal
    (BAD_REQUEST, INVALID_FIELD) read apart."""
    reason = " ".join([record["reason"] or "", *(f"{k}={v}" for k, v in sorted(record["reason_metadata"].items()))])
    if record.get("skip_code"):
        reason += f" [{record['skip_code']}]"
    if record.get("skipped_without_sending"):
        reason += " (not sent)"
    truncated = record["requests"].get("truncated", 0)
    if truncated:
        reason += f" {truncated} truncated"
    return reason.strip()


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _with_prefix_defaults(record: dict[str, Any]) -> dict[str, Any]:
    """The record with prefix_tokens 0 and prefix_groups 1 where it predates them."""
    return {"prefix_tokens": 0, "prefix_groups": 1, **record}


def _prefix_label(record: dict[str, Any]) -> str:
    tokens, groups = record.get("prefix_tokens", 0), record.get("prefix_groups", 1)
    return f"{tokens} x{groups}" if groups > 1 else str(tokens)


def _mean_cached(metrics: dict[str, Any]) -> float | None:
    """Mean cached prompt tokens per completed request; 0 in records that predate the field."""
    return metrics.get("mean_cached_prompt_tokens", 0.0 if metrics["completed"] else None)


def _context_label(record: dict[str, Any]) -> str:
    """The context length, or the dataset whose own prompts the point sent (context 0)."""
    if record["context_tokens"]:
        return str(record["context_tokens"])
    dataset = str(record.get("dataset") or "dataset")
    return "jsonl" if dataset.startswith("jsonl:") else dataset


def _sort_key(record: dict[str, Any]) -> tuple[str, str, int, int, int, int, int, float]:
    rate = record["request_rate"]
    return (_server_label(record), _engine_label(record["engine"]), record["context_tokens"],
            record.get("prefix_tokens", 0),
            record.get("prefix_groups", 1), record["max_new_tokens"], record["concurrency"],
            float("inf") if rate == "inf" else float(rate))


def build_table(records: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="sweep results", show_lines=False)
    table.caption = ("latencies in ms (p50 = median); eng = reported by the engine; failed = by status code; "
                     "prefix = shared prompt prefix tokens (x groups); cached = prompt tokens per completed "
                     "request that the engine's prefix cache supplied (mean)")
    slo = any(r.get("slo") for r in records)
    if slo:
        table.caption += "; good/s = requests/s meeting every SLO, SLO % = the share of requests meeting them"
    for name in ("server", "engine", "ctx", "prefix", "new", "conc", "rate", "status", "ok", "failed", "out tok/s", "req/s",
                 "cached", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "eng queue p50", "eng TTFT p50",
                 *(("good/s", "SLO %") if slo else ())):
        table.add_column(name, justify="left" if name in ("server", "engine", "status", "failed") else "right")
    table.add_column("reason", justify="left", overflow="fold", min_width=30)
    for r in sorted(records, key=_sort_key):
        m = r["metrics"]
        requests = r["requests"]
        failed = ", ".join(f"{code}:{n}" for code, n in requests["failed_by_code"].items()) or "0"
        reason = _reason_label(r)
        row = [_server_label(r), _engine_label(r["engine"]), _context_label(r), _prefix_label(r),
               str(r["max_new_tokens"] or "own"),
               str(r["concurrency"]), str(r["request_rate"]),
               f"[{_STATUS_STYLE.get(r['status'], 'white')}]{r['status']}[/]",
               str(requests["completed"]), failed]
        if m is None:
            row += ["-"] * (11 if slo else 9)
        else:
            row += [_fmt(m["output_throughput"]), _fmt(m["request_throughput"], 2), _fmt(_mean_cached(m)),
                    _fmt(m["ttft_ms"]["median"]), _fmt(m["ttft_ms"]["p99"]), _fmt(m["tpot_ms"]["median"], 2),
                    _fmt(m["itl_ms"]["p99"], 2), _fmt(m["engine_queue_ms"]["median"]),
                    _fmt(m["engine_ttft_ms"]["median"])]
            if slo:
                attainment = m.get("slo_attainment")
                row += [_fmt(m.get("request_goodput"), 2), _fmt(attainment * 100 if attainment is not None else None)]
        table.add_row(*row, reason)
    return table


def print_table(records: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    (console or Console(width=220)).print(build_table(records))


def write_plots(records: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the PNG plots into out_dir; returns their paths (none when no point has metrics)."""
    measured = [_with_prefix_defaults(r) for r in records
                if r["metrics"] is not None and r["metrics"]["completed"] > 0]
    if not measured:
        return []
    prefix = ("prefix_tokens", "prefix_groups") if any(r["prefix_tokens"] for r in measured) else ()
    throughput = _facet_plot(
        measured, out_dir / THROUGHPUT_PLOT, x_key="concurrency", x_label="concurrency",
        facet_keys=("context_tokens", "max_new_tokens", "request_rate", *prefix),
        panels=(("output throughput (tokens/s)", lambda m: m["output_throughput"]),),
        title="output throughput vs concurrency")
    by_context = [r for r in measured if r["context_tokens"]]
    if not by_context:
        return [throughput]  # a dataset's points have no one context length
    latency = _facet_plot(
        by_context, out_dir / LATENCY_PLOT, x_key="context_tokens", x_label="context length (tokens)",
        facet_keys=("concurrency", "max_new_tokens", "request_rate", *prefix),
        panels=(("median TTFT (ms)", lambda m: m["ttft_ms"]["median"]),
                ("median TPOT (ms)", lambda m: m["tpot_ms"]["median"])),
        title="TTFT and TPOT vs context length")
    return [throughput, latency]


_SHORT = {"context_tokens": "ctx", "max_new_tokens": "new", "request_rate": "rate", "concurrency": "conc",
          "prefix_tokens": "prefix", "prefix_groups": "groups"}


def _facet_plot(records: Sequence[dict[str, Any]], path: Path, *, x_key: str, x_label: str,
                facet_keys: tuple[str, ...], panels: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...],
                title: str) -> Path:
    """One column per combination of facet_keys, one row per panel, one line per engine configuration."""
    facets = sorted({tuple(str(r[k]) for k in facet_keys) for r in records},
                    key=lambda f: tuple(float(v) if v != "inf" else float("inf") for v in f))
    engines = sorted({_line_label(r) for r in records})
    colors = {label: f"C{i % 10}" for i, label in enumerate(engines)}
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), len(facets), figsize=(3.6 * len(facets) + 1, 3.2 * len(panels) + 0.6),
                             squeeze=False)
    for column, facet in enumerate(facets):
        chosen = [r for r in records if tuple(str(r[k]) for k in facet_keys) == facet]
        for row, (name, value_of) in enumerate(panels):
            ax = axes[row][column]
            for label in engines:
                points = sorted((r[x_key], value_of(r["metrics"])) for r in chosen
                                if _line_label(r) == label and value_of(r["metrics"]) is not None)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[label],
                            label=label)
            ax.set_title(" ".join(f"{_SHORT[k]}={v}" for k, v in zip(facet_keys, facet, strict=True)),
                         fontsize="small")
            ax.set_xlabel(x_label)
            if column == 0:
                ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize="small", title="server")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.88 if len(facets) < 3 else 0.93, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
