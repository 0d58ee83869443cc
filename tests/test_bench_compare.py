"""`compare`: ratios B / A per shared point, skipped and failed points shown as such, the points of one
side listed, a PNG plot; one run of several servers compared against its first server."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bench_client.__main__ import main
from bench_client.compare import MEASURES, Comparison, build_table, compare, compare_servers
from bench_client.export import load_run
from tests.test_bench_export import old_point, point, write_run

PNG = b"\x89PNG\r\n\x1a\n"


def table_rows(table_text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.replace("┃", "│").split("│")[1:-1]]
            for line in table_text.splitlines() if line.startswith(("│", "┃"))]


def rendered(comparison: Comparison) -> list[list[str]]:
    buffer = io.StringIO()
    Console(file=buffer, width=300).print(build_table(comparison))
    return table_rows(buffer.getvalue())


def runs(tmp_path: Path) -> tuple[Path, Path]:
    """A and B share three points (B twice as slow at one, skipped at one, failed at one); each has one of its own."""
    a = write_run(tmp_path / "a", [point(goodput=2.0), point(context=256), point(concurrency=8),
                                   point(concurrency=16)])
    b = write_run(tmp_path / "b", [point(scale=2.0, goodput=1.0), point(context=256, status="skipped"),
                                   point(concurrency=8, status="failed"), point(concurrency=32)])
    return a, b


def test_ratios_at_shared_points(tmp_path: Path) -> None:
    a, b = runs(tmp_path)
    comparison = compare(load_run(a), load_run(b), "A", "B")
    slow = next(row for row in comparison.rows if row.point.context_tokens == 64 and row.point.concurrency == 4)
    ratios = {m.name: slow.ratio(m) for m in MEASURES}
    assert ratios == {"TTFT p50": 2.0, "TPOT p50": 2.0, "ITL p50": 2.0, "E2EL p50": 2.0, "out tok/s": 0.5,
                      "goodput": 0.5}
    header, *rows = rendered(comparison)
    assert header[:8] == ["engine", "workload", "ctx", "prefix", "new", "conc", "rate", "TTFT p50"]
    assert "goodput" in header
    by_point = {(r[header.index("ctx")], r[header.index("conc")]): r for r in rows}
    assert by_point[("64", "4")][header.index("TTFT p50")] == "2.000"
    assert by_point[("64", "4")][header.index("out tok/s")] == "0.500"
    assert by_point[("64", "4")][header.index("engine")] == "max_batch=8"
    skipped, failed = by_point[("256", "4")], by_point[("64", "8")]
    assert skipped[header.index("TTFT p50")] == "-" and skipped[-1] == "B skipped (CONTEXT_LENGTH_EXCEEDED)"
    assert failed[header.index("out tok/s")] == "-" and failed[-1] == "B failed (ERROR_RATE_EXCEEDED)"
    assert [p.concurrency for p in comparison.only_a] == [16] and [p.concurrency for p in comparison.only_b] == [32]


def test_goodput_column_only_where_both_have_it(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [point(goodput=2.0)])
    b = write_run(tmp_path / "b", [point()])
    header, row = rendered(compare(load_run(a), load_run(b), "A", "B"))
    assert "goodput" not in header and row[header.index("TTFT p50")] == "1.000"


def test_records_older_than_the_workload_keys_match_their_defaults(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [old_point()])
    b = write_run(tmp_path / "b", [point(dataset="random", endpoint="completions", api="engine.v1"),
                                   point(dataset="sharegpt")])
    comparison = compare(load_run(a), load_run(b), "A", "B")
    assert [(r.point.dataset, r.point.endpoint) for r in comparison.rows] == [("random", "completions")]
    assert [p.dataset for p in comparison.only_b] == ["sharegpt"]


def test_compare_command_prints_the_table_lists_the_rest_and_writes_a_png(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs(tmp_path)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    default = tmp_path / "b_vs_a.png"  # beside RUN_B
    assert f"wrote {default}" in out and default.read_bytes()[:8] == PNG
    assert f"1 point(s) only in A ({a}):" in out and f"1 point(s) only in B ({b}):" in out
    assert "conc=16" in out and "conc=32" in out
    assert f"B / A  (A = {a}, B = {b})" in out and "B skipped (CONTEXT_LENGTH_EXCEEDED)" in out
    chosen = tmp_path / "plots" / "ratios.png"
    chosen.parent.mkdir()
    assert main(["compare", str(a), str(b), "--plot", str(chosen)]) == 0
    assert chosen.read_bytes()[:8] == PNG and f"wrote {chosen}" in capsys.readouterr().out


def test_no_shared_point_is_said_and_no_plot_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", [point(concurrency=1)])
    b = write_run(tmp_path / "b", [point(concurrency=2)])
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"no point is in both {a} and {b}" in out and "no plot: no shared point has a ratio" in out
    assert not (tmp_path / "b_vs_a.png").exists()


def test_one_run_compares_its_servers_against_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "sweep", [point(server="vllm"), point(server="ours", scale=0.5),
                                         point(server="llama", scale=4.0), point(server="ours", concurrency=8)])
    records = load_run(run)
    comparisons = compare_servers(records, "sweep")
    assert [(c.a_name, c.b_name) for c in comparisons] == [("vllm", "ours"), ("vllm", "llama")]
    ours, llama = comparisons
    assert [row.ratio(MEASURES[0]) for row in ours.rows] == [0.5] and [p.concurrency for p in ours.only_b] == [8]
    assert [row.ratio(MEASURES[4]) for row in llama.rows] == [0.25]
    header, row = rendered(llama)
    assert "server" not in header and row[header.index("TTFT p50")] == "4.000"
    assert main(["compare", str(run)]) == 0
    out = capsys.readouterr().out
    assert "ours / vllm" in out and "llama / vllm" in out and "1 point(s) only in ours:" in out
    assert (tmp_path / "sweep_servers.png").read_bytes()[:8] == PNG


def test_one_run_of_one_server_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "sweep", [point(server="only")])
    assert main(["compare", str(run)]) == 2
    assert f"{str(run)!r} measured 1 server(s) ['only']" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["a", "b"])
def test_an_unreadable_run_is_exit_2_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     which: str) -> None:
    good = write_run(tmp_path / "good", [point()])
    missing = tmp_path / "missing"
    args = [str(missing), str(good)] if which == "a" else [str(good), str(missing)]
    assert main(["compare", *args]) == 2
    assert f"{str(missing)!r} is not a directory" in capsys.readouterr().err


def test_a_mangled_record_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = point()
    del broken["concurrency"]
    a = write_run(tmp_path / "a", [broken])
    b = write_run(tmp_path / "b", [point()])
    assert main(["compare", str(a), str(b)]) == 2
    assert "lacks or mangles a field (KeyError: 'concurrency')" in capsys.readouterr().err


def test_compare_as_a_subprocess(tmp_path: Path) -> None:
    a, b = runs(tmp_path)
    plot = tmp_path / "out.png"
    done = subprocess.run([sys.executable, "-m", "bench_client", "compare", str(a), str(b), "--plot", str(plot)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "2.000" in done.stdout and plot.read_bytes()[:8] == PNG
    help_text = subprocess.run([sys.executable, "-m", "bench_client", "compare", "--help"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
    assert "against the first" in help_text
