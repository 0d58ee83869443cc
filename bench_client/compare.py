"""Compare two runs point by point: the ratio B / A of each latency and throughput.

`python -m bench_client compare RUN_A RUN_B [--plot FILE]`: a point of A and a point of B are the
same point when they share server name, engine settings, dataset, endpoint, context, prefix, new
tokens, concurrency and request rate (older records read as results.py and export.DEFAULTS say).
`compare RUN [--plot FILE]`: the servers of one sweep ([servers.a], [servers.b], ...) pairwise against
the first (the server of the run's first point), at the points they share.

Per shared point: TTFT, TPOT, ITL and E2EL medians, output tokens/s, and request goodput where both
points have it. A ratio below 1 is a shorter latency (better) for the four latencies and a lower
throughput (worse) for the last two. A point skipped or failed on either side is shown as such, with
its reason, and has no ratios; a ratio whose baseline is 0 or missing is "-". The points of only one
side are listed below the table. Where a run records a point more than once, the last record counts.

The plot: one panel per comparison, the ratios per point as bars around a line at 1 (a point skipped or
failed on a side has no bars; its label says so). Written to --plot, else beside RUN_B as
RUN_B_vs_RUN_A.png (one run: beside RUN as RUN_servers.png); none when no shared point has a ratio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench_client.export import with_defaults
from bench_client.figures import pyplot
from bench_client.results import ResultsError, engine_key, rate_from_json


@dataclass(frozen=True)
class Measure:
    name: str
    value: Callable[[Mapping[str, Any]], float | None]  # of a point's metrics
    lower_is_better: bool


MEASURES = (
    Measure("TTFT p50", lambda m: m["ttft_ms"]["median"], True),
    Measure("TPOT p50", lambda m: m["tpot_ms"]["median"], True),
    Measure("ITL p50", lambda m: m["itl_ms"]["median"], True),
    Measure("E2EL p50", lambda m: m["e2el_ms"]["median"], True),
    Measure("out tok/s", lambda m: m["output_throughput"], False),
    Measure("goodput", lambda m: m.get("request_goodput"), False),
)
GOODPUT = MEASURES[-1]
SAME = 0.05  # a ratio within 5% of 1 is not coloured


@dataclass(frozen=True, order=True)
class PointId:
    """What makes two points the same point across runs (or across the servers of one run)."""

    server: str
    engine: str  # canonical JSON of the engine settings, "null" for a running target
    dataset: str
    endpoint: str
    context_tokens: int
    prefix_tokens: int
    prefix_groups: int
    max_new_tokens: int
    concurrency: int
    request_rate: float

    @classmethod
    def of_record(cls, raw: Mapping[str, Any], *, server: bool = True) -> PointId:
        """`server=False`: the point apart from its server, to compare the servers of one run."""
        r = with_defaults(raw)
        return cls(server=str(r["server"]) if server else "", engine=engine_key(r["engine"]),
                   dataset=str(r["dataset"]), endpoint=str(r["endpoint"]), context_tokens=int(r["context_tokens"]),
                   prefix_tokens=int(r["prefix_tokens"]), prefix_groups=int(r["prefix_groups"]),
                   max_new_tokens=int(r["max_new_tokens"]), concurrency=int(r["concurrency"]),
                   request_rate=rate_from_json(r["request_rate"]))

    def cells(self) -> list[str]:
        """server, engine, workload, ctx, prefix, new, conc, rate."""
        settings = json.loads(self.engine)
        engine = "target" if settings is None else ",".join(f"{k}={v}" for k, v in sorted(settings.items())) or "engine"
        prefix = f"{self.prefix_tokens} x{self.prefix_groups}" if self.prefix_groups > 1 else str(self.prefix_tokens)
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return [self.server, engine, f"{self.dataset} {self.endpoint}", str(self.context_tokens), prefix,
                str(self.max_new_tokens), str(self.concurrency), rate]

    def label(self) -> str:
        server, engine, workload, ctx, prefix, new, conc, rate = self.cells()
        return " ".join(part for part in (server, engine, workload, f"ctx={ctx}", f"prefix={prefix}", f"new={new}",
                                          f"conc={conc}", f"rate={rate}") if part)


@dataclass(frozen=True)
class ComparisonRow:
    """One point of both sides."""

    point: PointId
    a: Mapping[str, Any]
    b: Mapping[str, Any]

    def note(self, a_name: str, b_name: str) -> str:
        """"" when both points ran ok; else which side skipped or failed it, and why."""
        notes = [f"{name} {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
                 for name, r in ((a_name, self.a), (b_name, self.b)) if r["status"] != "ok"]
        return "; ".join(notes)

    def ratio(self, measure: Measure) -> float | None:
        """B / A of the measure; None unless both points ran ok and A's value is a number other than 0."""
        if self.a["status"] != "ok" or self.b["status"] != "ok" or not self.a["metrics"] or not self.b["metrics"]:
            return None
        a, b = measure.value(self.a["metrics"]), measure.value(self.b["metrics"])
        if a is None or b is None or a == 0:
            return None
        return b / a


@dataclass(frozen=True)
class Comparison:
    """B against A: the shared points, and those of one side only."""

    a_name: str  # a run's path, or a server's name
    b_name: str
    rows: list[ComparisonRow]
    only_a: list[PointId]
    only_b: list[PointId]
    show_server: bool  # False when the sides are servers of one run (the names say which)
    a_tag: str = "A"  # how the table's notes name the sides
    b_tag: str = "B"

    @property
    def title(self) -> str:
        if (self.a_tag, self.b_tag) == (self.a_name, self.b_name):
            return f"{self.b_name} / {self.a_name}"
        return f"{self.b_tag} / {self.a_tag}  ({self.a_tag} = {self.a_name}, {self.b_tag} = {self.b_name})"

    def side(self, tag: str) -> str:
        name = self.a_name if tag == self.a_tag else self.b_name
        return tag if tag == name else f"{tag} ({name})"

    def measures(self) -> list[Measure]:
        """The measures shown: goodput only where some shared point has it on both sides."""
        has_goodput = any(row.ratio(GOODPUT) is not None for row in self.rows)
        return [m for m in MEASURES if m is not GOODPUT or has_goodput]


def _by_point(records: Sequence[Mapping[str, Any]], *, server: bool) -> dict[PointId, Mapping[str, Any]]:
    return {PointId.of_record(r, server=server): r for r in records}  # the last record of a point counts


def compare(a_records: Sequence[Mapping[str, Any]], b_records: Sequence[Mapping[str, Any]], a_name: str,
            b_name: str, *, show_server: bool = True, tags: tuple[str, str] = ("A", "B")) -> Comparison:
    """B / A at each point both record. Records whose fields are missing or mangled raise ResultsError."""
    try:
        a = _by_point(a_records, server=show_server)
        b = _by_point(b_records, server=show_server)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ResultsError(f"a point record of {a_name!r} or {b_name!r} lacks or mangles a field "
                           f"({type(err).__name__}: {err})") from err
    shared = sorted(a.keys() & b.keys())
    return Comparison(a_name, b_name, [ComparisonRow(p, a[p], b[p]) for p in shared], sorted(a.keys() - b.keys()),
                      sorted(b.keys() - a.keys()), show_server, *tags)


def compare_servers(records: Sequence[Mapping[str, Any]], run_name: str) -> list[Comparison]:
    """Each server of one run against the first (the server of its first point). ValueError when the run
    measured one server."""
    servers = list(dict.fromkeys(str(with_defaults(r)["server"]) for r in records))
    if len(servers) < 2:
        raise ValueError(f"{run_name!r} measured {len(servers)} server(s) {servers}; compare needs two runs "
                         "or one run of several [servers.NAME]")
    base, *others = servers

    def of(server: str) -> list[Mapping[str, Any]]:
        return [r for r in records if with_defaults(r)["server"] == server]

    return [compare(of(base), of(other), base, other, show_server=False, tags=(base, other)) for other in others]


def _ratio_cell(ratio: float | None, measure: Measure) -> str:
    if ratio is None:
        return "-"
    better = ratio < 1 - SAME if measure.lower_is_better else ratio > 1 + SAME
    worse = ratio > 1 + SAME if measure.lower_is_better else ratio < 1 - SAME
    style = "green" if better else "red" if worse else ""
    return f"[{style}]{ratio:.3f}[/]" if style else f"{ratio:.3f}"


def build_table(comparison: Comparison) -> Table:
    c = comparison
    table = Table(title=c.title)
    table.caption = ("ratio B / A at each shared point (p50 = median); green: B better by over 5%, red: worse; "
                     "'-': no ratio (a side skipped or failed the point, or a value is missing or 0 in A)")
    columns = ["server", "engine", "workload", "ctx", "prefix", "new", "conc", "rate"]
    named = any(p.server for p in (*(row.point for row in c.rows), *c.only_a, *c.only_b))
    first = 0 if c.show_server and named else 1  # no server column for runs of one unnamed server
    measures = c.measures()
    for name in columns[first:]:
        table.add_column(name, justify="left" if name in ("server", "engine", "workload") else "right")
    for measure in measures:
        table.add_column(measure.name, justify="right")
    table.add_column("note", justify="left", overflow="fold")
    for row in c.rows:
        note = row.note(c.a_tag, c.b_tag)
        ratios = ["-" if note else _ratio_cell(row.ratio(m), m) for m in measures]
        table.add_row(*row.point.cells()[first:], *ratios, f"[yellow]{note}[/]" if note else "")
    return table


def print_comparison(comparison: Comparison, console: Console | None = None) -> None:
    """The table, then the points of one side only (counted and named)."""
    console = console or Console(width=220)
    console.print(build_table(comparison))
    for tag, points in ((comparison.a_tag, comparison.only_a), (comparison.b_tag, comparison.only_b)):
        if points:
            console.print(f"{len(points)} point(s) only in {comparison.side(tag)}:", markup=False)
            for point in points:
                console.print(f"  {point.label()}", markup=False, highlight=False)
    if not comparison.rows:
        console.print(f"no point is in both {comparison.a_name} and {comparison.b_name}", markup=False)


def write_plot(comparisons: Sequence[Comparison], path: Path) -> Path | None:
    """One panel per comparison: the ratios per shared point as grouped bars; None when no point has a ratio."""
    if not any(row.ratio(m) is not None for c in comparisons for row in c.rows for m in MEASURES):
        return None
    widest = max(len(c.rows) for c in comparisons)
    plt = pyplot()
    fig, axes = plt.subplots(len(comparisons), 1, figsize=(max(7.0, 1.2 * widest + 3), 4.5 * len(comparisons)),
                             squeeze=False)
    for ax, c in zip(axes[:, 0], comparisons, strict=True):
        measures = c.measures()
        width = 0.8 / len(measures)
        for i, measure in enumerate(measures):
            xs = [x + (i - (len(measures) - 1) / 2) * width for x in range(len(c.rows))]
            heights = [row.ratio(measure) for row in c.rows]
            ax.bar([x for x, h in zip(xs, heights, strict=True) if h is not None],
                   [h for h in heights if h is not None], width=width, color=f"C{i}", label=measure.name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(c.rows)))
        ax.set_xticklabels([_tick(row, c) for row in c.rows], rotation=30, ha="right", fontsize="x-small")
        ax.set_ylabel(f"ratio {c.b_tag} / {c.a_tag}")
        tallest = max((row.ratio(m) or 0.0 for row in c.rows for m in measures), default=1.0)
        ax.set_ylim(0, max(tallest, 1.0) * 1.1)
        ax.set_title(c.title, fontsize="small")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _tick(row: ComparisonRow, comparison: Comparison) -> str:
    """The point's parameters; a point skipped or failed on a side says so (it has no bars)."""
    point = row.point
    server, engine, workload, ctx, prefix, new, conc, rate = point.cells()
    head = f"{server} " if comparison.show_server and server else ""
    if (point.dataset, point.endpoint) != ("random", "completions"):
        head += f"{workload} "
    statuses = [f"{tag} {r['status']}" for tag, r in ((comparison.a_tag, row.a), (comparison.b_tag, row.b))
                if r["status"] != "ok"]
    tail = f" ({', '.join(statuses)})" if statuses else ""
    return f"{head}{engine} c{ctx} p{prefix} n{new} x{conc} r{rate}{tail}"
